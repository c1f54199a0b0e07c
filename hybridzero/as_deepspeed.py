"""``import hybridzero.as_deepspeed``: the one-line opt-in to hybridzero's ``deepspeed`` alias.

Importing this module installs the alias (:func:`hybridzero.deepspeed_alias.install`; never over a real DeepSpeed).
Put it before the first import of transformers or accelerate. As a runner it needs no change to the script::

    python -m hybridzero.as_deepspeed train.py --my-args ...
    torchrun --nproc_per_node 2 -m hybridzero.as_deepspeed train.py --my-args ...

runs ``train.py`` as ``__main__`` with the alias installed (``sys.argv`` = the script and its arguments, its folder
first on ``sys.path``, as ``python train.py`` has them). Under a launcher (``LOCAL_RANK`` set, as torchrun sets it)
the script also gets ``--local_rank=N`` first among its arguments, as DeepSpeed's launcher passes it (DeepSpeed-Chat's
``main.py`` files read it); ``--no_local_rank`` before the script turns that off, as DeepSpeed's launcher flag of that
name does, and an explicit ``--local_rank`` among the script's arguments is left alone.
"""

from __future__ import annotations

import os
import runpy
import sys

from hybridzero.deepspeed_alias import install

__all__ = ["ACTIVE", "launcher_argv", "main"]

ACTIVE: bool = install()
"""Whether the alias is active in this process (False when a real DeepSpeed is installed: it is used instead)."""


def launcher_argv(args: list[str], local_rank: str | None, no_local_rank: bool) -> list[str]:
    """``args`` (script first) with ``--local_rank=N`` inserted after the script when a launcher set ``LOCAL_RANK``,
    unless turned off or already given (pure)."""
    given = any(a == "--local_rank" or a.startswith("--local_rank=") for a in args[1:])
    if local_rank is None or no_local_rank or given:
        return list(args)
    return [args[0], f"--local_rank={local_rank}", *args[1:]]


def main(argv: list[str] | None = None) -> None:
    """Run the script named by ``argv[0]`` (default ``sys.argv[1:]``) as ``__main__`` with the alias installed."""
    args = list(sys.argv[1:] if argv is None else argv)
    no_local_rank = bool(args) and args[0] == "--no_local_rank"
    args = args[1:] if no_local_rank else args
    if not args or args[0] in ("-h", "--help"):
        raise SystemExit("usage: python -m hybridzero.as_deepspeed [--no_local_rank] SCRIPT.py [ARGS...]")
    sys.argv = launcher_argv(args, os.environ.get("LOCAL_RANK"), no_local_rank)
    sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))  # as `python SCRIPT.py` does
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
