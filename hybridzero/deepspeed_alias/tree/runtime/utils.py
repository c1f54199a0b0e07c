"""``deepspeed.runtime.utils``: ``move_to_device`` (Accelerate's ALST example moves micro-batches with it)."""

from __future__ import annotations

from typing import Any

from hybridzero.deepspeed_alias.unprovided import missing_attribute
from hybridzero.runtime.ulysses_data import move_to_device

__all__ = ["move_to_device"]


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.runtime.utils", name)
