"""``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad`` (:mod:`hybridzero.ops.adagrad`: torch's Adagrad with DeepSpeed's
signature; accelerate maps a torch ``Adagrad`` to it under optimizer offload)."""

from __future__ import annotations

from hybridzero.ops.adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
