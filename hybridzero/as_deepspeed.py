"""``import hybridzero.as_deepspeed``: the one-line opt-in to hybridzero's ``deepspeed`` alias.

Importing this module installs the alias (:func:`hybridzero.deepspeed_alias.install`; never over a real DeepSpeed).
Put it before the first import of transformers or accelerate. As a runner it needs no change to the script::

    python -m hybridzero.as_deepspeed train.py --my-args ...
    torchrun --nproc_per_node 2 -m hybridzero.as_deepspeed train.py --my-args ...

runs ``train.py`` as ``__main__`` with the alias installed (``sys.argv`` = the script and its arguments, its folder
first on ``sys.path``, as ``python train.py`` has them).
"""

from __future__ import annotations

import os
import runpy
import sys

from hybridzero.deepspeed_alias import install

__all__ = ["ACTIVE", "main"]

ACTIVE: bool = install()
"""Whether the alias is active in this process (False when a real DeepSpeed is installed: it is used instead)."""


def main(argv: list[str] | None = None) -> None:
    """Run the script named by ``argv[0]`` (default ``sys.argv[1:]``) as ``__main__`` with the alias installed."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        raise SystemExit("usage: python -m hybridzero.as_deepspeed SCRIPT.py [ARGS...]")
    sys.argv = list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))  # as `python SCRIPT.py` does
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
