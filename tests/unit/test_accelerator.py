"""``hybridzero.accelerator``: DeepSpeed's accelerator names on CPU (the CUDA branch delegates to ``torch.cuda``)."""

from __future__ import annotations

import pytest
import torch

from hybridzero.accelerator import Accelerator, get_accelerator


def test_selection_follows_ds_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert get_accelerator() == Accelerator("cpu")
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu'.*cpu, cuda"):
        get_accelerator()
    monkeypatch.delenv("DS_ACCELERATOR")
    assert get_accelerator().kind == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="'tpu' is not supported"):
        Accelerator("tpu")


def test_cpu_answers_as_deepspeeds_cpu_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    acc = Accelerator("cpu")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (acc.device_name(), acc.device_name(3), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.current_device() == 1 and acc._name == "cpu"
    assert acc.communication_backend_name() == "gloo"
    fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())  # DeepSpeed's CPU accelerator asks oneDNN too
    assert acc.is_bf16_supported() and acc.is_fp16_supported() == fp16
    assert acc.supported_dtypes() == [torch.float32, torch.bfloat16] + ([torch.float16] if fp16 else [])
    assert acc.is_available() and acc.is_synchronized_device() and acc.device() is None
    acc.set_device(1)  # no-ops on CPU
    acc.synchronize()
    acc.empty_cache()
    x = torch.ones(3)
    assert acc.on_accelerator(x) and acc.pin_memory(x) is x
    assert 0 < acc.memory_allocated() <= acc.max_memory_allocated() <= acc.total_memory()
    assert acc.memory_stats()["allocated_bytes.all.peak"] > 0
    with acc.stream(acc.current_stream()):
        pass


def test_cpu_rng_is_torchs_global_generator() -> None:
    acc = Accelerator("cpu")
    acc.manual_seed_all(7)
    a = torch.rand(4)
    acc.manual_seed(7)
    state = acc.get_rng_state()
    b = torch.rand(4)
    acc.set_rng_state(state)
    assert torch.equal(a, b) and torch.equal(torch.rand(4), b)
    assert acc.initial_seed() == 7 and acc.random() is torch.random


def test_compiled_op_builders_are_refused_by_name() -> None:
    with pytest.raises(NotImplementedError, match="'CPUAdamBuilder'.*FusedAdam"):
        Accelerator("cpu").create_op_builder("CPUAdamBuilder")
