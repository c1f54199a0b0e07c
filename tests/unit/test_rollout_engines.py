"""The rollout-engine layer without starting vLLM: the truncated IS weights against a hand computation, the
settings / config keys and their one-line errors, the missing-vLLM and unsupported-model errors, and the bounded
weight iterator (one ZeRO-3 group at a time, LoRA merged, shards untouched) on a world-1 engine."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from pydantic import ValidationError

from hybridzero.config.errors import ConfigError
from hybridzero.config.load import load_config
from hybridzero.rlhf.rollout.backends import RolloutEngineError, VLLMEngine, VLLMOptions, truncated_is_weights
from hybridzero.rlhf.rollout.backends.vllm_engine import import_vllm
from hybridzero.rlhf.rollout.backends.weights import hf_weight_buckets
from hybridzero.rlhf.settings import GRPOSettings, PPOSettings
from tests.harness.models import tiny_llama


def test_truncated_is_weights_match_a_hand_computation() -> None:
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, -4.0]])
    sampler = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -2.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    got = truncated_is_weights(trainer, sampler, mask, cap=2.0)
    # by hand: exp(t - s) per token, capped at 2, 1 off the mask
    want = torch.tensor(
        [[math.exp(0.5), math.exp(-1.0), 1.0], [math.exp(-2.8), 2.0, 2.0]]  # exp(1.9)=6.69 and exp(5)=148 -> cap
    )
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    assert got.dtype == torch.float32
    with pytest.raises(ValueError, match="cap = 0"):
        truncated_is_weights(trainer, sampler, mask, cap=0.0)
    with pytest.raises(ValueError, match="shapes differ"):
        truncated_is_weights(trainer, sampler[:, :2], mask, cap=2.0)


def test_settings_and_config_name_the_rollout_engine_and_what_it_cannot_do() -> None:
    assert PPOSettings().rollout_engine == "hf" and GRPOSettings(rollout_engine="vllm").rollout_engine == "vllm"
    with pytest.raises(ValidationError, match="rollout_engine"):
        GRPOSettings(rollout_engine="sglang")
    assert PPOSettings(rollout_engine="vllm", inference_tp_size=2).inference_tp_size == 2  # one engine per 2 ranks
    with pytest.raises(ValidationError, match="vllm_importance_sampling_correction needs rollout_engine = 'vllm'"):
        GRPOSettings(vllm_importance_sampling_correction=True)
    base = {"train_micro_batch_size_per_gpu": 1}
    assert load_config({**base, "hybrid_engine": {"rollout_engine": "vllm"}}, 1).hybrid_engine.rollout_engine == "vllm"
    with pytest.raises(ConfigError) as err:
        load_config({**base, "hybrid_engine": {"rollout_engine": "sglang"}}, 1)
    assert "hybrid_engine.rollout_engine" in str(err.value) and "vllm" in str(err.value)


def test_vllm_dtype_defaults_to_the_training_dtype_and_may_differ() -> None:
    from hybridzero.rlhf.rollout.backends import build_vllm_engine

    config = tiny_llama(head_dim=32).config
    for dtype in ("fp32", "bf16"):  # default: the training dtype
        assert build_vllm_engine(GRPOSettings(rollout_engine="vllm", dtype=dtype), config, 1, 0).opts.dtype == dtype
    s = GRPOSettings(rollout_engine="vllm", dtype="fp32", vllm_dtype="bf16")
    assert build_vllm_engine(s, config, 1, 0).opts.dtype == "bf16"  # sampler bf16, trainer fp32
    with pytest.raises(ValidationError, match="vllm_dtype"):
        GRPOSettings(rollout_engine="vllm", vllm_dtype="fp8")


def test_a_tensor_parallel_size_that_cannot_split_the_world_or_the_model_fails_in_one_line() -> None:
    from hybridzero.rlhf.rollout.backends import build_vllm_engine
    from hybridzero.rlhf.rollout.backends.vllm_tp import _mismatch, valid_tp_sizes

    even = tiny_llama(
        hidden_size=36, head_dim=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=66
    ).config
    s = GRPOSettings(rollout_engine="vllm", inference_tp_size=2)
    assert build_vllm_engine(s, even, 4, 3).opts.tensor_parallel_size == 2  # two engines of two ranks
    assert valid_tp_sizes(even, 4) == [1, 2]  # 66 / 4 is not whole
    assert valid_tp_sizes(
        tiny_llama(hidden_size=36, head_dim=32, num_attention_heads=4, intermediate_size=64).config, 4
    ) == [1, 2, 4]
    cases = [  # (config, tp, world, expected pieces)
        (even, 2, 3, ["inference_tp_size = 2", "does not divide the world size 3", "valid: 1"]),
        (even, 4, 4, ["cannot split Llama's intermediate_size = 66 over 4 ranks", "valid here: 1, 2"]),
        (tiny_llama().config, 2, 2, ["num_attention_heads = 5", "intermediate_size = 67", "valid here: 1"]),
    ]
    for config, tp, world, pieces in cases:
        with pytest.raises(RolloutEngineError) as err:
            build_vllm_engine(GRPOSettings(rollout_engine="vllm", inference_tp_size=tp), config, world, 0)
        message = str(err.value)
        assert "\n" not in message and all(p in message for p in pieces), message
    # kv heads (vLLM's rule): split when t divides them, replicated when they divide t, refused otherwise
    one_kv = tiny_llama(
        hidden_size=36, head_dim=32, num_attention_heads=4, num_key_value_heads=1, intermediate_size=64
    ).config
    three_kv = tiny_llama(
        hidden_size=36, head_dim=32, num_attention_heads=6, num_key_value_heads=3, intermediate_size=66
    ).config
    assert valid_tp_sizes(one_kv, 4) == [1, 2, 4] and valid_tp_sizes(three_kv, 2) == [1]
    assert _mismatch([{"a": 1}, {"a": 1}]) is None
    problem = _mismatch([{"top_k": 0, "eos_id": 2}, {"top_k": 0, "eos_id": 3}])
    assert problem is not None and "eos_id differs within a group (group rank 0: 2, group rank 1: 3)" in problem


def test_missing_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an interpreter without the package sees
    with pytest.raises(RolloutEngineError) as err:
        import_vllm()
    message = str(err.value)
    assert "\n" not in message and "extra `vllm`" in message and "--rollout_engine hf" in message


def test_an_unsupported_head_size_fails_in_one_line_before_any_engine() -> None:
    pytest.importorskip("vllm")
    config = tiny_llama().config  # head_dim 8: vLLM's CPU attention has no kernel for it
    engine = VLLMEngine(config, VLLMOptions(), 1, 0)
    if torch.cuda.is_available():
        pytest.skip("the head-size limit is the CPU build's")
    with pytest.raises(RolloutEngineError) as err:
        engine.start()
    message = str(err.value)
    assert "\n" not in message and "Llama" in message and "head size 8" in message and "--rollout_engine hf" in message
    assert engine.llm is None and engine._dir is None


def test_weight_buckets_are_one_group_at_a_time_lora_merged_and_leave_the_shards() -> None:
    import hybridzero
    from hybridzero.lora import convert_linear_layer_to_lora, merged_weights

    model = tiny_llama(seed=3)
    convert_linear_layer_to_lora(model, "layers.", lora_dim=3, lora_scaling=2.0)
    with torch.no_grad():  # non-zero adapters, so the merge shows
        for name, p in model.named_parameters():
            if "lora_left" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = merged_weights(state, scaling=2.0)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = hybridzero.initialize(model=model, config=cfg)
    groups = [g for g in engine.coordinator.groups if not g.always_full]
    assert len(groups) >= 3
    seen: dict[str, torch.Tensor] = {}
    for bucket in hf_weight_buckets(engine):
        owners = {g.owner for g in groups if g.full is not None}
        assert len(owners) <= 1  # never more than the block being handed out (its trainable and frozen groups)
        seen.update({n: t.clone() for n, t in bucket})
    assert set(seen) == set(want)
    assert all(torch.equal(seen[n], want[n]) for n in want)
    assert all(g.full is None for g in groups)
    ledger = engine.comm.ledger.total("all_gather", phase="rollout_sync")
    assert ledger.calls == len(groups) and len({g.owner for g in groups}) < len(groups)  # LoRA: 2 groups a block
