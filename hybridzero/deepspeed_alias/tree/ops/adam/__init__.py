"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` (:mod:`hybridzero.ops.adam`: torch's Adam with
DeepSpeed's defaults; accelerate maps a torch Adam/AdamW to ``DeepSpeedCPUAdam`` under optimizer offload)."""

from __future__ import annotations

from hybridzero.ops.adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
