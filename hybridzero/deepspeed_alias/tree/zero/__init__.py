"""``deepspeed.zero``: hybridzero's ``zero.Init``, ``GatheredParameters`` and external-parameter registration."""

from __future__ import annotations

from typing import Any

from hybridzero.deepspeed_alias.unprovided import missing_attribute
from hybridzero.zero import GatheredParameters, Init
from hybridzero.zero.external import register_external_parameter, unregister_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.zero", name)
