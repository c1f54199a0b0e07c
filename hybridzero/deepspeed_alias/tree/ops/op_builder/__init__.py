"""``deepspeed.ops.op_builder``: DeepSpeed's builder classes, ``is_compatible()`` answering what hybridzero
provides (:mod:`hybridzero.ops.op_builder`); ``load()`` is refused (nothing is compiled)."""

from __future__ import annotations

from typing import Any

from hybridzero.deepspeed_alias.unprovided import missing_attribute
from hybridzero.ops.op_builder import ALL_BUILDERS, OpBuilder

__all__ = ["OpBuilder", *sorted(ALL_BUILDERS)]

globals().update(ALL_BUILDERS)


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.ops.op_builder", name)
