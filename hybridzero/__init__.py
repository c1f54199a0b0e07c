"""hybridzero: ZeRO-3 sharded training with DeepSpeed's API shape.

The top-level package is the DeepSpeed namespace: ``import hybridzero as deepspeed`` runs DeepSpeed user code
(``deepspeed.initialize``, ``deepspeed.init_distributed``, ``deepspeed.add_config_arguments``, ``deepspeed.comm``,
``deepspeed.zero.GatheredParameters``, ``deepspeed.utils.safe_get_full_*``, ``deepspeed.get_accelerator``).
hybridzero's own additions: :class:`Engine`, :class:`ConfigError`, :class:`PeerFailure`, :func:`from_pretrained`.
"""

from __future__ import annotations

import hybridzero.runtime.zero.partition_parameters  # noqa: F401 - deepspeed.runtime.zero.* as attributes
from hybridzero import comm, utils, zero
from hybridzero.accelerator import get_accelerator
from hybridzero.comm import init_distributed
from hybridzero.comm.collectives import PeerFailure
from hybridzero.config import ConfigError
from hybridzero.runtime.arguments import add_config_arguments
from hybridzero.runtime.engine import Engine
from hybridzero.runtime.initialize import initialize
from hybridzero.runtime.pretrained import from_pretrained
from hybridzero.zero.gathered import GatheredParameters

__all__ = [
    "ConfigError",
    "Engine",
    "GatheredParameters",
    "PeerFailure",
    "add_config_arguments",
    "comm",
    "from_pretrained",
    "get_accelerator",
    "init_distributed",
    "initialize",
    "utils",
    "zero",
]
__version__ = "0.1.0"
