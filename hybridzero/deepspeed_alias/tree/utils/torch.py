"""``deepspeed.utils.torch``: ``required_torch_version`` (whether the installed torch is within bounds)."""

from __future__ import annotations

import torch
from packaging.version import Version

__all__ = ["required_torch_version"]


def required_torch_version(min_version: float | str | None = None, max_version: float | str | None = None) -> bool:
    """True when torch's ``major.minor`` is >= ``min_version`` and <= ``max_version`` (either may be None)."""
    installed = Version(".".join(torch.__version__.split("+")[0].split(".")[:2]))
    if min_version is not None and installed < Version(str(min_version)):
        return False
    return max_version is None or installed <= Version(str(max_version))
