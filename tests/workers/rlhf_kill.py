"""A step-3 run killed with SIGKILL at a chosen moment of a multi-role checkpoint save (a real process, no cleanup).

``python -m tests.workers.rlhf_kill SETTINGS_JSON ROLE ITERATION`` runs PPO with the settings in the JSON file and
kills its own process (``kill -9``: no ``finally``, no atexit, no flush) right before role ``ROLE`` starts saving
iteration ``ITERATION`` — so the roles saved before it are on disk and the rest are not. The hook wraps
``Engine.save_checkpoint`` of this test process only; nothing in the package changes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from hybridzero.rlhf.settings import PPOSettings
from hybridzero.rlhf.steps.rl.trainer import train_step3
from hybridzero.runtime.engine import Engine
from tests.workers.rlhf_runs import STEP3_DEFAULTS


def _kill_before(role: str, iteration: int) -> None:
    """Replace ``Engine.save_checkpoint`` with a wrapper that SIGKILLs this process before ``role``'s save."""
    original = Engine.save_checkpoint

    def save_checkpoint(self: Engine, save_dir: str, tag: str | None = None, *args: Any, **kwargs: Any) -> Any:
        if Path(save_dir).name == role and tag == f"iter{iteration}":
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, save_dir, tag, *args, **kwargs)

    Engine.save_checkpoint = save_checkpoint  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    settings_path, role, iteration = argv
    _kill_before(role, int(iteration))
    train_step3(PPOSettings(**{**STEP3_DEFAULTS, **json.loads(Path(settings_path).read_text())}))
    return 0  # not reached when the kill fires


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
