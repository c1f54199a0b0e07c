"""``hybridzero.zero``: DeepSpeed's ``deepspeed.zero`` names (and the package of the sharding machinery)."""
from __future__ import annotations

from hybridzero.zero.gathered import GatheredParameters

__all__ = ["GatheredParameters"]

# zero.Init (hybridzero/zero/init.py, another slice) is exported on its own line here:
