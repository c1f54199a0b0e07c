"""``deepspeed.runtime.zero.partition_parameters``: ``ZeroParamStatus`` (hybridzero.runtime.zero's) and what
transformers' ``prevent_arange_dtype_change`` reads.

DeepSpeed's ``zero.Init`` replaces torch's tensor constructors with ``zero_wrapper_for_fp_tensor_constructor(fn,
target_fp_dtype, target_device)`` (casting to the config dtype); transformers swaps that wrapper, for the duration of
model construction, for one that spares ``torch.arange`` (``_orig_torch_arange``). hybridzero's ``zero.Init`` replaces
no constructor and never casts one, so the wrapper here returns ``fn`` unchanged and is never called by us: swapping
it changes nothing, which is exactly the behaviour transformers wants.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybridzero.accelerator import get_accelerator
from hybridzero.runtime.zero.partition_parameters import ZeroParamStatus
from hybridzero.zero import GatheredParameters, Init

__all__ = [
    "GatheredParameters",
    "Init",
    "MultipleAllGatherHandles",
    "ZeroParamStatus",
    "get_accelerator",
    "partitioned_param_data_shape",
    "zero_wrapper_for_fp_tensor_constructor",
]

_orig_torch_arange = torch.arange

partitioned_param_data_shape = [0]
"""DeepSpeed's shape of a partitioned parameter's ``.data`` outside a gather: an engine's ZeRO-3 parameters and those
built under ``zero.Init`` have it; the whole shape is ``param.ds_shape``."""


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """DeepSpeed's constructor wrapper; hybridzero's ``zero.Init`` does not wrap constructors, so ``fn`` itself."""
    del args, kwargs
    return fn


class MultipleAllGatherHandles:
    """DeepSpeed's handle over several pending all-gathers: ``wait`` waits on each in order, passing
    ``handle_dependency`` through (hybridzero's own gathers are :class:`hybridzero.comm.collectives.PendingCollective`
    objects; this is the DeepSpeed-shaped container user code builds over handles)."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = list(handles)

    def wait(self, handle_dependency: bool = True) -> None:
        """Wait on every handle, in order."""
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)
