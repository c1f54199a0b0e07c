"""``deepspeed.runtime.zero.partition_parameters``: :class:`ZeroParamStatus`, DeepSpeed's per-parameter ZeRO-3 state.

DeepSpeed patches ``ds_id`` / ``ds_status`` / ``ds_tensor`` onto every ZeRO-3 parameter; hybridzero keeps that state
in its gather groups and patches nothing onto tensors. A ZeRO-3 engine's parameters are
:class:`hybridzero.runtime.zero_param.ZeroParameter`, whose ``ds_status`` property reads this enum off the
parameter's gather group, so DeepSpeed-Chat's ``hasattr(p, "ds_id") and p.ds_status == NOT_AVAILABLE`` works as
written.
"""

from __future__ import annotations

import enum

__all__ = ["ZeroParamStatus"]


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's values: whole on this rank, partitioned, or being gathered."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3
