"""``deepspeed.zero``: hybridzero's ``zero.Init`` and ``GatheredParameters``."""

from __future__ import annotations

from typing import Any

from hybridzero.deepspeed_alias.unprovided import missing_attribute, unprovided
from hybridzero.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]

register_external_parameter = unprovided(
    "deepspeed.zero.register_external_parameter",
    "hybridzero gathers a ZeRO-3 parameter for the forward of the block that owns it (and the root module's "
    "parameters for the whole forward); it has no registry of parameters used outside their block",
)
unregister_external_parameter = unprovided(
    "deepspeed.zero.unregister_external_parameter", "see deepspeed.zero.register_external_parameter"
)


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.zero", name)
