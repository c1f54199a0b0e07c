"""``deepspeed.git_version_info``: the version and build facts DeepSpeed's tests and tools read."""

from __future__ import annotations

import torch

from hybridzero.deepspeed_alias.finder import alias_version
from hybridzero.ops.op_builder import COMPATIBLE_OPS

__all__ = ["compatible_ops", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]

version = alias_version()
git_hash = "[none]"
git_branch = "[none]"
installed_ops = dict.fromkeys(COMPATIBLE_OPS, False)  # nothing is compiled
compatible_ops = dict(COMPATIBLE_OPS)


def _nccl_version() -> str:
    """``"major.minor"`` of the NCCL this torch carries; ``"0.0"`` without CUDA (DeepSpeed's value for no NCCL)."""
    if not torch.cuda.is_available():
        return "0.0"
    try:
        found = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return "0.0"
    return f"{found[0]}.{found[1]}"


# The keys DeepSpeed's build records ("0.0": absent), read from this process's torch instead of a build.
torch_info = {
    "version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": torch.version.cuda or "0.0",
    "nccl_version": _nccl_version(),
    "hip_version": getattr(torch.version, "hip", None) or "0.0",
}
