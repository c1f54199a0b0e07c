"""``zero.Init`` pieces that need no process group: argument errors, the placeholder, the staged source."""

from __future__ import annotations

import pytest
import torch

from hybridzero.zero import Init
from hybridzero.zero.init_source import StagedSource
from hybridzero.zero.init_store import placeholder


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"remote_device": "nvme"}, ["remote_device='nvme'", "'cpu'"]),
        ({"mpu": object()}, ["mpu", "mpu=None"]),
        ({"zero_param_parallel_group": object()}, ["zero_param_parallel_group"]),
        ({"zero_quantized_weights": True}, ["zero_quantized_weights"]),
        ({"dtype": torch.int8}, ["dtype=torch.int8", "floating"]),
        ({"config": {}, "config_dict_or_path": {}}, ["config_dict_or_path=", "config="]),
    ],
)
def test_bad_arguments_name_the_key(kwargs: dict, names: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        Init(**kwargs)
    for name in names:
        assert name in str(info.value)


def test_disabled_context_is_eager() -> None:
    torch.manual_seed(3)
    want = torch.nn.Linear(5, 7).weight.detach().clone()
    torch.manual_seed(3)
    with Init(enabled=False) as ctx:
        got = torch.nn.Linear(5, 7).weight
    assert ctx.store is None and torch.equal(got, want) and got.stride() == (5, 1)


def test_placeholder_is_deepspeeds_size_0_tensor_of_the_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        p = placeholder(dtype, torch.device("cpu"))
        assert p.shape == (0,) and p.dtype == dtype and p.untyped_storage().nbytes() == 0


def test_staged_source_serves_only_what_was_staged() -> None:
    src = StagedSource({"w": torch.Size([2, 5])}, {"w": torch.float32}, {"w": (3, torch.arange(4.0))})
    assert src.names() == ["w"] and src.shape("w") == (2, 5) and src.dtype("w") == torch.float32
    assert src.read_flat("w", 4, 6).tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match=r"\[2, 6\) were not staged"):
        src.read_flat("w", 2, 6)
    with pytest.raises(ValueError):
        src.read_flat("w", 5, 11)
