"""``deepspeed.runtime.zero.partition_parameters``: :class:`ZeroParamStatus`, DeepSpeed's per-parameter ZeRO-3 state.

DeepSpeed patches ``ds_id`` / ``ds_status`` / ``ds_tensor`` onto every ZeRO-3 parameter; hybridzero keeps that state
in its gather groups and patches nothing onto tensors (a parameter's availability is its group's state, see
:mod:`hybridzero.zero.groups`). The enum is provided so code that imports it runs; code that tests
``hasattr(p, "ds_id")`` takes its non-ZeRO-3 branch (see README, "DeepSpeed-Chat's own code").
"""

from __future__ import annotations

import enum

__all__ = ["ZeroParamStatus"]


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's values: whole on this rank, partitioned, or being gathered."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3
