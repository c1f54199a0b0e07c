"""Opt-in: ``import deepspeed`` resolves to hybridzero when DeepSpeed itself is not installed.

For code that imports ``deepspeed`` itself — Hugging Face ``Trainer(args=TrainingArguments(deepspeed=cfg))``,
Accelerate's DeepSpeed plugin, ``from_pretrained`` under ``HfDeepSpeedConfig`` — where ``import hybridzero as
deepspeed`` cannot be written. Turn it on with one line before transformers/accelerate look for DeepSpeed::

    import hybridzero.as_deepspeed  # noqa: F401  (or: hybridzero.deepspeed_alias.install())

or without touching the script: ``python -m hybridzero.as_deepspeed script.py ARGS`` /
``torchrun --nproc_per_node N -m hybridzero.as_deepspeed script.py ARGS``.

What it serves and how it never shadows a real DeepSpeed: :mod:`hybridzero.deepspeed_alias.finder`. The modules
served, and which DeepSpeed names each provides, are the files of ``hybridzero/deepspeed_alias/tree/``; a name they
lack fails naming it (``AttributeError`` / ``ModuleNotFoundError`` saying hybridzero does not provide it).

The one piece of process-wide state is the finder's entry in ``sys.meta_path`` (what the opt-in asks for): installing
is idempotent, :func:`uninstall` removes it again.
"""

from __future__ import annotations

import sys
import warnings

from hybridzero.deepspeed_alias.finder import (
    DEEPSPEED_API_VERSION,
    DeepSpeedAliasFinder,
    alias_version,
    is_alias_module,
    provided_modules,
    real_deepspeed_spec,
)

__all__ = [
    "DEEPSPEED_API_VERSION",
    "alias_version",
    "install",
    "is_installed",
    "provided_modules",
    "uninstall",
]


def is_installed() -> bool:
    """True while the alias finder is in ``sys.meta_path``."""
    return DeepSpeedAliasFinder() in sys.meta_path


def install() -> bool:
    """Serve ``import deepspeed`` from hybridzero unless a real DeepSpeed is importable; True if the alias is active.

    A real DeepSpeed (on ``sys.path``, or already imported) wins: nothing is installed, a warning says so, and
    False is returned. Idempotent.
    """
    loaded = sys.modules.get("deepspeed")
    if loaded is not None and not is_alias_module(loaded):
        warnings.warn(
            "a real deepspeed is already imported; hybridzero's deepspeed alias is not installed", stacklevel=2
        )
        return False
    real = real_deepspeed_spec()
    if real is not None:
        warnings.warn(
            f"DeepSpeed is installed ({real.origin}); hybridzero's deepspeed alias is not installed and "
            f"`import deepspeed` keeps resolving to it",
            stacklevel=2,
        )
        return False
    if not is_installed():
        sys.meta_path.append(DeepSpeedAliasFinder())
    return True


def uninstall() -> None:
    """Remove the finder and forget the ``deepspeed`` modules it served (objects already handed out stay valid)."""
    while DeepSpeedAliasFinder() in sys.meta_path:
        sys.meta_path.remove(DeepSpeedAliasFinder())
    for name in [n for n, m in sys.modules.items() if (n == "deepspeed" or n.startswith("deepspeed."))]:
        if is_alias_module(sys.modules[name]) or sys.modules[name] is None:
            del sys.modules[name]
