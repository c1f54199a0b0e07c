"""hybridzero: ZeRO-3 sharded training with DeepSpeed's API shape.

Public API: :func:`initialize`, :func:`init_distributed`, :class:`Engine`, :class:`ConfigError`,
:class:`PeerFailure`, :func:`GatheredParameters`. Attributes load lazily so that ``import hybridzero.testing`` (in freshly spawned workers)
stays cheap.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["initialize", "init_distributed", "Engine", "ConfigError", "PeerFailure", "GatheredParameters", "from_pretrained"]
__version__ = "0.1.0"

_WHERE = {
    "initialize": "hybridzero.runtime.initialize",
    "init_distributed": "hybridzero.comm.collectives",
    "PeerFailure": "hybridzero.comm.collectives",
    "Engine": "hybridzero.runtime.engine",
    "ConfigError": "hybridzero.config",
    "GatheredParameters": "hybridzero.zero.gathered",
    "from_pretrained": "hybridzero.runtime.pretrained",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'hybridzero' has no attribute {name!r}")
