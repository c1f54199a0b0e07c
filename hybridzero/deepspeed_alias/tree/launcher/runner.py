"""``deepspeed.launcher.runner``: the constant accelerate's launcher reads. The launcher itself is not provided:
use ``torchrun`` (or ``hybridzero launch``)."""

from __future__ import annotations

from typing import Any

from hybridzero.deepspeed_alias.unprovided import missing_attribute

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME"]

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.launcher.runner", name)
