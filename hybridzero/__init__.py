"""hybridzero: ZeRO-3 sharded training with DeepSpeed's API shape.

Public API: :func:`initialize`, :func:`init_distributed`, :class:`Engine`, :class:`ConfigError`,
:class:`PeerFailure`, :func:`GatheredParameters`, :func:`from_pretrained`.
"""
from __future__ import annotations

from hybridzero.comm.collectives import PeerFailure, init_distributed
from hybridzero.config import ConfigError
from hybridzero.runtime.engine import Engine
from hybridzero.runtime.initialize import initialize
from hybridzero.runtime.pretrained import from_pretrained
from hybridzero.zero.gathered import GatheredParameters

__all__ = ["initialize", "init_distributed", "Engine", "ConfigError", "PeerFailure", "GatheredParameters",
           "from_pretrained"]
__version__ = "0.1.0"
