"""``deepspeed.comm``: hybridzero.comm (``torch.distributed``'s functions plus ``init_distributed``,
``get_local_rank``)."""

from __future__ import annotations

from typing import Any

from hybridzero.comm import *  # noqa: F403  (the whole public face of hybridzero.comm, as its __all__ lists it)
from hybridzero.comm import __all__ as __all__
from hybridzero.deepspeed_alias.unprovided import missing_attribute


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.comm", name)
