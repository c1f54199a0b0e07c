"""``hybridzero.zero``: DeepSpeed's ``deepspeed.zero`` names (and the package of the sharding machinery)."""

from __future__ import annotations

from hybridzero.zero.external import register_external_parameter, unregister_external_parameter
from hybridzero.zero.gathered import GatheredParameters
from hybridzero.zero.init import Init

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]
