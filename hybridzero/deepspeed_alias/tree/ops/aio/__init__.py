"""``deepspeed.ops.aio``: ``AsyncIOBuilder`` (compatible where libaio is installed, as DeepSpeed's)."""

from __future__ import annotations

from hybridzero.ops.op_builder import ALL_BUILDERS

__all__ = ["AsyncIOBuilder"]

AsyncIOBuilder = ALL_BUILDERS["AsyncIOBuilder"]
