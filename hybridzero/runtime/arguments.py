"""``add_config_arguments(parser)``: DeepSpeed's command-line arguments, for scripts that parse their own."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's group: ``--deepspeed`` (flag for user code), ``--deepspeed_config PATH`` (read by
    ``initialize(args=...)``), and the deprecated ``--deepscale`` / ``--deepscale_config``. Returns ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (a flag for user code; no effect on the engine)",
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated: use --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated: use --deepspeed_config")
    return parser
