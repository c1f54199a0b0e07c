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
torch_info = {
    "version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
    "cuda_version": torch.version.cuda or "0.0",
    "hip_version": getattr(torch.version, "hip", None) or "0.0",
}
