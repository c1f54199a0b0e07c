"""``deepspeed.git_version_info.torch_info`` has every key DeepSpeed's build records (its tests index
``nccl_version`` and ``bf16_support``), each read from this process's torch ("0.0" where absent)."""

from __future__ import annotations

import re

import torch


def test_torch_info_has_deepspeeds_keys() -> None:
    from hybridzero.deepspeed_alias.tree.git_version_info import torch_info

    assert set(torch_info) == {"version", "bf16_support", "cuda_version", "nccl_version", "hip_version"}
    for key in ("version", "cuda_version", "nccl_version", "hip_version"):
        assert re.match(r"\d+\.\d+", torch_info[key]), (key, torch_info[key])
    assert torch_info["version"] == ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert isinstance(torch_info["bf16_support"], bool)
    if not torch.cuda.is_available():
        assert (torch_info["nccl_version"], torch_info["bf16_support"]) == ("0.0", False)
