"""``deepspeed.runtime.swap_tensor``: ``MIN_SWAPPABLE_BYTES``, DeepSpeed's smallest tensor worth swapping to NVMe
(1 MiB; hybridzero's NVMe offload swaps every sharded master and state chunk regardless)."""

from __future__ import annotations

__all__ = ["MIN_SWAPPABLE_BYTES"]

MIN_SWAPPABLE_BYTES = 1024**2
