r"""``deepspeed.runtime.zero.partition_parameters``: :class:`ZeroParamStatus`, DeepSpeed's per-parameter ZeRO-3 state.

DeepSpeed patches ``ds_id`` / ``ds_status`` / ``ds_tensor`` onto every partitioned parameter; hybridzero keeps that
state in the parameter's owner (an engine's gather groups, a ``zero.Init`` store) and patches nothing onto tensors.
Partitioned parameters are :class:`hybridzero.zero.param_view.ZeroParameter`\s, whose ``ds_status`` property asks the
owner, so DeepSpeed-Chat's ``hasattr(p, "ds_id") and p.ds_status == NOT_AVAILABLE`` works as written.
"""

from __future__ import annotations

from hybridzero.zero.param_view import ZeroParamStatus

__all__ = ["ZeroParamStatus"]
