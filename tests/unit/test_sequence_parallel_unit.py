"""Pure parts of Ulysses sequence parallelism: the config key and its batch arithmetic, the model checks, label
shifting and padding, the group layout, and the exchange's layout at world 1 (the identity, still recorded)."""

from __future__ import annotations

import pytest
import torch
import transformers

from hybridzero.comm.collectives import Comm
from hybridzero.comm.ledger import Ledger
from hybridzero.config import ConfigError, load_config
from hybridzero.runtime.sequence_parallel import check_model, pad_to_multiple, shift_labels, sp_groups
from hybridzero.runtime.ulysses import causal_mask, heads_to_seq, seq_to_heads


def test_batch_is_resolved_against_world_over_s() -> None:
    cfg = load_config(
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "sequence_parallel_size": 2},
        world_size=8,
    )
    assert (cfg.train_batch_size, cfg.dp_world_size, cfg.sequence_parallel_size) == (2 * 3 * 4, 4, 2)
    cfg = load_config(
        {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "sequence_parallel_size": 4}, world_size=8
    )
    assert cfg.gradient_accumulation_steps == 2
    assert load_config({"train_batch_size": 8}, world_size=8).sequence_parallel_size == 1


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (3, "sequence_parallel_size = 3 does not divide world_size = 4"),
        (0, "sequence_parallel_size"),
        ("2", "sequence_parallel_size"),
    ],
)
def test_bad_sequence_parallel_size_names_key(value: object, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_config({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": value}, world_size=4)


def _llama_config(heads: int, kv: int, impl: str = "sdpa", **extra: object) -> transformers.LlamaConfig:
    cfg = transformers.LlamaConfig(
        hidden_size=4 * heads, num_attention_heads=heads, num_key_value_heads=kv, head_dim=4, **extra
    )
    cfg._attn_implementation = impl
    return cfg


def test_check_model() -> None:
    check_model(_llama_config(4, 1), 2)  # kv heads < s: repeated
    check_model(_llama_config(4, 4, "eager"), 4)
    check_model(_llama_config(5, 5, "flash_attention_2"), 1)  # s = 1: nothing to check
    with pytest.raises(ValueError, match=r"must divide num_attention_heads = 6 .*valid sizes: 1, 2, 3, 6"):
        check_model(_llama_config(6, 2), 4)
    with pytest.raises(ValueError, match="attn_implementation = 'flash_attention_2' cannot be split"):
        check_model(_llama_config(4, 2, "flash_attention_2"), 2)
    mistral = transformers.MistralConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    mistral._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="sliding_window = 8 is not supported"):
        check_model(mistral, 2)


def test_shift_and_pad() -> None:
    labels = torch.tensor([[5, 6, 7, 8, 9]])
    assert shift_labels(labels, None).tolist() == [[6, 7, 8, 9, -100]]
    mask = torch.tensor([[1, 1, 1, 0, 0]])  # right padding: targets of pads ignored
    assert shift_labels(labels, mask).tolist() == [[6, 7, -100, -100, -100]]
    assert pad_to_multiple(labels, 2, -100).tolist() == [[5, 6, 7, 8, 9, -100]]
    assert pad_to_multiple(labels, 5, 0) is labels
    assert sp_groups(6, 3) == [[0, 1, 2], [3, 4, 5]]


def test_exchange_layout_and_mask_at_world_1() -> None:
    ledger = Ledger()
    comm = Comm(ledger)
    x = torch.randn(2, 3, 5, 4)  # [B, H, L, D]
    assert torch.equal(seq_to_heads(x, 1, comm), x)
    assert torch.equal(heads_to_seq(x.transpose(1, 2), 1, comm), x.transpose(1, 2))
    assert ledger.total("sp_all_to_all").calls == 2
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_to_all(torch.empty(4, 2), torch.empty(2, 4).t(), phase="forward")
    allowed = causal_mask(3, torch.float32, torch.device("cpu"), additive=False)[0, 0]
    assert allowed.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    additive = causal_mask(3, torch.float32, torch.device("cpu"), additive=True)[0, 0]
    assert additive[0, 1] == torch.finfo(torch.float32).min and additive[1, 0] == 0


def test_plan_models_sequence_parallel() -> None:
    """Llama-7B (32 heads, head_dim 128, 32 layers), fp16, seq 2048 at world 8: activations halve at s = 2 (every
    term holds half the positions or half the heads), and each layer's two all-to-alls in forward move the packed
    q|k|v plus the output of the 1024 local positions: (32 + 2 * 32 + 32) * 128 * 1024 * 2 bytes."""
    from hybridzero.plan.model import load_hf_config, meta_model
    from hybridzero.plan.planner import Cluster, Workload, plan_model
    from hybridzero.plan.profiles import device_profile, links_for

    hf = load_hf_config("llama-7b")
    model = meta_model(hf)
    raw = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        "fp16": {"enabled": True},
    }
    cluster = Cluster(1, 8, device_profile("a100-80gb"), links_for("a100-80gb"))
    one = plan_model(model, hf, raw, cluster, Workload(2048))
    two = plan_model(model, hf, {**raw, "sequence_parallel_size": 2}, cluster, Workload(2048))
    a1, a2 = one["memory"]["activations"], two["memory"]["activations"]
    for key in ("no_checkpointing", "checkpointing"):
        assert abs(a2[key] * 2 - a1[key]) <= 2, key  # int() of each estimate: at most 1 byte off each
    sp = two["sequence_parallel"]
    assert "sequence_parallel" not in one
    assert sp["all_to_all_bytes_per_layer_forward"] == (32 + 64 + 32) * 128 * 1024 * 2
    assert sp["all_to_alls_per_micro_step"] == 4 * 32 and sp["data_parallel_size"] == 4
    assert sp["all_to_all_bytes_per_step"] == sp["all_to_all_bytes_per_layer_forward"] * 32 * 2
