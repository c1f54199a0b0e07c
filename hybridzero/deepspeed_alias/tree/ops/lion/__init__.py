"""``deepspeed.ops.lion``: ``DeepSpeedCPULion`` and ``FusedLion`` (:mod:`hybridzero.ops.lion`: one torch Lion with
DeepSpeed's signatures and defaults; accelerate maps a 32-bit bitsandbytes Lion to ``DeepSpeedCPULion`` under
optimizer offload)."""

from __future__ import annotations

from hybridzero.ops.lion import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
