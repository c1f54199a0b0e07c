"""``deepspeed.accelerator``: ``get_accelerator`` (:mod:`hybridzero.accelerator`) and
``is_current_accelerator_supported``."""

from __future__ import annotations

from hybridzero.accelerator import get_accelerator

__all__ = ["get_accelerator", "is_current_accelerator_supported"]

SUPPORTED_ACCELERATOR_LIST = ("cpu", "cuda")


def is_current_accelerator_supported() -> bool:
    """Whether the accelerator in use is one hybridzero runs on (``cpu`` or ``cuda``: always, once chosen)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST
