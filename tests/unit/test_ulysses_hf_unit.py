"""One-process checks of DeepSpeed's ALST/Ulysses names on hybridzero (no process group needed):

* the data loader adapter's sharding of one whole batch (``shard_gathered``): right-padding to a multiple of s with
  the right fill per key, global ``position_ids``, ``shift_labels`` shifted on the whole row before the split, other
  values passed whole; concatenated over the ranks it is the padded, shifted batch;
* packed rows (restarting ``position_ids``): the whole row's block-causal mask, no target across sequences;
* what it refuses, naming the key and the fix: position_ids of another shape, left padding, missing labels;
* ``register_with_transformers``' refusals before any group is formed (a hub name, a core implementation that is not
  the model's, an unsplittable one) and the config's ``sequence_parallel_size`` against the mpu's.
"""

from __future__ import annotations

import pytest
import torch

from hybridzero.runtime.initialize import with_sequence_parallel
from hybridzero.runtime.ulysses_data import _checked_batch, move_to_device, packed_segments, shard_gathered
from hybridzero.runtime.ulysses_hf import REGISTRY, register_with_transformers
from tests.harness.models import tiny_llama


def _batch() -> dict[str, object]:
    ids = torch.arange(10, 23).view(1, 13).repeat(2, 1)
    labels = ids.clone()
    labels[:, :4] = -100
    return _checked_batch({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids), "tag": "x"})


def test_shards_concatenate_to_the_padded_shifted_batch() -> None:
    whole = _batch()
    parts = [shard_gathered(whole, r, 3, pad_token_id=7) for r in range(3)]  # 13 -> 15 positions, 5 per rank
    cat = {k: torch.cat([p[k] for p in parts], dim=1) for k in ("input_ids", "position_ids", "shift_labels")}
    ids = whole["input_ids"]
    assert isinstance(ids, torch.Tensor)
    assert torch.equal(cat["input_ids"], torch.cat([ids, torch.full((2, 2), 7)], dim=1))
    assert torch.equal(cat["position_ids"], torch.arange(15).expand(2, -1))
    want = torch.full((2, 15), -100)
    want[:, 3:12] = ids[:, 4:13]  # position t predicts token t + 1; the prompt's targets and the padding are ignored
    assert torch.equal(cat["shift_labels"], want)
    assert all("labels" not in p and p["tag"] == "x" and p["input_ids"].shape == (2, 5) for p in parts)
    assert torch.equal(torch.cat([p["attention_mask"] for p in parts], dim=1)[:, 13:], torch.zeros(2, 2).long())


def test_packed_rows_get_the_whole_rows_block_causal_mask() -> None:
    """Positions restarting inside a row (two sequences of 3 and 4 tokens, 7 -> 8 positions at s = 2): per-sequence
    positions sliced, the boolean block-causal mask of the whole padded row on every rank, no target across."""
    ids = torch.arange(10, 17)[None]
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    whole = _checked_batch({"input_ids": ids, "labels": ids, "position_ids": positions})
    parts = [shard_gathered(whole, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([p["position_ids"] for p in parts], dim=1), torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]))
    targets = torch.cat([p["shift_labels"] for p in parts], dim=1)
    assert targets.tolist() == [[11, 12, -100, 14, 15, 16, -100, -100]]
    segments = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    want = (segments[:, None] == segments[None, :]) & torch.ones(8, 8, dtype=torch.bool).tril()
    for p in parts:
        assert p["attention_mask"].dtype == torch.bool and torch.equal(p["attention_mask"], want[None, None])
    assert packed_segments(torch.arange(5)[None]) is None


def test_refusals_name_the_key_and_the_fix() -> None:
    ids = torch.ones(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="position_ids must be a tensor of input_ids' shape"):
        _checked_batch({"input_ids": ids, "labels": ids, "position_ids": torch.tensor([[0, 1, 2]])})
    with pytest.raises(ValueError, match="pad on the right"):
        _checked_batch({"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1]])})
    with pytest.raises(ValueError, match="need tensor labels"):
        _checked_batch({"input_ids": ids})
    with pytest.raises(ValueError, match="shorter than the sequence parallel size 8"):
        shard_gathered(_checked_batch({"input_ids": ids, "labels": ids}), 0, 8)
    moved = move_to_device({"a": [ids, (ids, 3)]}, torch.device("cpu"))
    assert torch.equal(moved["a"][1][0], ids) and moved["a"][1][1] == 3


def test_register_refuses_before_forming_groups() -> None:
    model = tiny_llama(0, num_attention_heads=2, num_key_value_heads=1, hidden_size=38, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="needs the model object"):
        register_with_transformers("org/model", "sdpa", 2, 1)
    with pytest.raises(ValueError, match="does not match the model's attn_implementation = 'sdpa'"):
        register_with_transformers(model, "flash_attention_2", 2, 1)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="cannot be split by sequence_parallel_size = 2"):
        register_with_transformers(model, None, 2, 1)
    with pytest.raises(ValueError, match="must be a multiple of sequence_parallel_size = 2"):
        register_with_transformers(model, None, 2, 1, seq_length=9, seq_length_is_variable=False)
    assert register_with_transformers(model, None, 1, 1) is None  # s = 1: nothing to do, as DeepSpeed
    assert REGISTRY.active is None


def test_config_sequence_parallel_size_must_agree_with_the_mpu() -> None:
    assert with_sequence_parallel({"train_batch_size": 2}, 2)["sequence_parallel_size"] == 2
    assert with_sequence_parallel({"sequence_parallel_size": 2}, 2)["sequence_parallel_size"] == 2
    with pytest.raises(ValueError, match="config sequence_parallel_size = 4 but the mpu's sequence parallel world"):
        with_sequence_parallel({"sequence_parallel_size": 4}, 2)
