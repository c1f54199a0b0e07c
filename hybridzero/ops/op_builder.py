"""DeepSpeed's op builders (``deepspeed.ops.op_builder``), answering what hybridzero provides.

DeepSpeed compiles C++/CUDA ops through builder classes; user code and tests ask a builder ``is_compatible()``
(or read ``deepspeed.ops.__compatible_ops__[Builder.NAME]``) before choosing a code path. hybridzero compiles
nothing: a builder is compatible exactly when hybridzero provides that op's Python API, which matches what
DeepSpeed's CPU accelerator answers for the ops it has:

* ``cpu_adam``, ``fused_adam`` (``deepspeed.ops.adam``'s ``DeepSpeedCPUAdam`` / ``FusedAdam``), ``cpu_adagrad``
  (``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``), ``cpu_lion``, ``fused_lion`` (``deepspeed.ops.lion``'s
  ``DeepSpeedCPULion`` / ``FusedLion``), ``pin_memory``: compatible (DeepSpeed's CPU accelerator has all but
  ``fused_lion``, a CUDA kernel there; here it is the same torch code as ``cpu_lion``);
* ``async_io`` (NVMe offload): compatible where DeepSpeed's would be, i.e. where libaio is installed (its shared
  library and header); hybridzero's own NVMe offload needs neither and works everywhere;
* every other op (inference kernels, Lamb, quantizers, sparse attention, oneCCL...): not compatible.

``load()`` never compiles: it raises ``NotImplementedError`` naming the op (hybridzero's ops are plain torch).
Builders are stateless; :data:`COMPATIBLE_OPS` is an immutable view computed once at import.
"""

from __future__ import annotations

import ctypes.util
import os
from types import MappingProxyType
from typing import Any, ClassVar

import torch

__all__ = ["ALL_BUILDERS", "COMPATIBLE_OPS", "OpBuilder", "builder_named"]

_PROVIDED = frozenset({"cpu_adam", "fused_adam", "cpu_adagrad", "cpu_lion", "fused_lion", "pin_memory"})
_LIBAIO_HEADERS = ("/usr/include/libaio.h", "/usr/local/include/libaio.h")


def libaio_installed() -> bool:
    """Whether libaio's shared library and header are present (what DeepSpeed's ``async_io`` builder needs)."""
    return ctypes.util.find_library("aio") is not None and any(os.path.isfile(h) for h in _LIBAIO_HEADERS)


class OpBuilder:
    """A DeepSpeed op builder: ``NAME``, ``is_compatible()``, ``load()`` (refused: nothing is compiled)."""

    NAME: ClassVar[str] = "deepspeed_not_implemented"

    def __init__(self, name: str | None = None) -> None:
        self.name = self.NAME if name is None else name

    def absolute_name(self) -> str:
        """DeepSpeed's module name for the compiled op."""
        return f"deepspeed.ops.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """True when hybridzero provides this op (see the module docstring)."""
        del verbose
        if self.name == "async_io":
            return libaio_installed()
        return self.name in _PROVIDED

    def load(self, verbose: bool = True) -> Any:
        """DeepSpeed compiles and imports the op here; hybridzero has no compiled ops."""
        del verbose
        raise NotImplementedError(
            f"deepspeed.ops.op_builder: op {self.name!r} is not compiled by hybridzero (its ops are plain torch; "
            f"use the Python API, e.g. deepspeed.ops.adam.DeepSpeedCPUAdam)"
        )

    def builder(self) -> Any:
        """DeepSpeed's extension builder: not available (see :meth:`load`)."""
        return self.load()

    @staticmethod
    def installed_rocm_version() -> tuple[int, int]:
        """``(0, 0)``: no ROCm build."""
        return (0, 0)

    @staticmethod
    def installed_cuda_version(name: str = "") -> tuple[int, int]:
        """``(0, 0)``: no CUDA build of ops."""
        del name
        return (0, 0)

    @staticmethod
    def is_rocm_pytorch() -> bool:
        """Whether torch is a ROCm build."""
        return getattr(torch.version, "hip", None) is not None


_NAMES = {
    "AsyncIOBuilder": "async_io",
    "CCLCommBuilder": "deepspeed_ccl_comm",
    "CPUAdagradBuilder": "cpu_adagrad",
    "CPUAdamBuilder": "cpu_adam",
    "CPULionBuilder": "cpu_lion",
    "DeepCompileBuilder": "dc",
    "EvoformerAttnBuilder": "evoformer_attn",
    "FPQuantizerBuilder": "fp_quantizer",
    "FusedAdamBuilder": "fused_adam",
    "FusedLambBuilder": "fused_lamb",
    "FusedLionBuilder": "fused_lion",
    "GDSBuilder": "gds",
    "InferenceBuilder": "transformer_inference",
    "InferenceCoreBuilder": "inference_core_ops",
    "InferenceCutlassBuilder": "cutlass_ops",
    "NotImplementedBuilder": "deepspeed_not_implemented",
    "PinMemoryBuilder": "pin_memory",
    "QuantizerBuilder": "quantizer",
    "RaggedOpsBuilder": "ragged_device_ops",
    "RaggedUtilsBuilder": "ragged_ops",
    "RandomLTDBuilder": "random_ltd",
    "ShareMemCommBuilder": "deepspeed_shm_comm",
    "SparseAttnBuilder": "sparse_attn",
    "SpatialInferenceBuilder": "spatial_inference",
    "StochasticTransformerBuilder": "stochastic_transformer",
    "TransformerBuilder": "transformer",
    "UtilsBuilder": "utils",
}

ALL_BUILDERS: MappingProxyType[str, type[OpBuilder]] = MappingProxyType(
    {
        cls: type(cls, (OpBuilder,), {"NAME": name, "__doc__": f"DeepSpeed's ``{name}`` op."})
        for cls, name in _NAMES.items()
    }  # noqa: E501
)
"""Builder class by DeepSpeed's class name."""

COMPATIBLE_OPS: MappingProxyType[str, bool] = MappingProxyType(
    {b.NAME: b().is_compatible() for b in ALL_BUILDERS.values()}
)
"""``deepspeed.ops.__compatible_ops__``: op name -> whether hybridzero provides it."""


def builder_named(class_name: str) -> type[OpBuilder] | None:
    """The builder class DeepSpeed calls ``class_name`` (``get_accelerator().get_op_builder``), or None."""
    return ALL_BUILDERS.get(class_name)
