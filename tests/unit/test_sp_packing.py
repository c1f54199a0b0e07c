"""Packed rows under sequence parallelism, the pure parts: each rank's slice of a packed batch, the whole row's
block-causal mask, targets that never cross a sequence, and the Ulysses core's use of a given 4D mask."""

from __future__ import annotations

import pytest
import torch

from hybridzero.packing import block_causal_mask, pack_lists, shifted_labels
from hybridzero.runtime.sp_packing import IGNORE_INDEX, packed_targets, shard_packed
from hybridzero.runtime.ulysses import causal_mask, core_mask

SEQS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]  # capacity 5: rows [5], [3, 2] -> width 5, odd


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_slices_rebuild_the_padded_rows(size: int) -> None:
    packed = pack_lists(SEQS, pad_id=0)
    parts = [shard_packed(packed, r, size, pad_token_id=0) for r in range(size)]
    width = packed.input_ids.shape[1]
    padded = width + (-width % size)
    for key in ("input_ids", "position_ids", "shift_labels"):
        whole = torch.cat([p[key] for p in parts], dim=1)
        assert whole.shape == (2, padded)
        if key != "shift_labels":
            original = packed.input_ids if key == "input_ids" else packed.position_ids
            assert torch.equal(whole[:, :width], original)
            assert bool((whole[:, width:] == 0).all())
    mask = parts[0]["attention_mask"]
    assert all(torch.equal(p["attention_mask"], mask) for p in parts)  # the whole row's, on every rank
    segments = torch.nn.functional.pad(packed.segments, (0, padded - width), value=-1)
    assert torch.equal(mask, block_causal_mask(segments))


def test_positions_restart_and_targets_stay_inside_each_sequence() -> None:
    packed = pack_lists(SEQS, pad_id=0)
    row = int(packed.row[2])  # the row holding [12, 13, 14] then [10, 11]
    assert packed.position_ids[row].tolist() == [0, 1, 2, 0, 1]
    targets = packed_targets(packed, None)
    assert targets[row].tolist() == [13, 14, IGNORE_INDEX, 11, IGNORE_INDEX]
    labels = shifted_labels(packed, [[-100, 6, 7, 8, 9], [10, 11], [-100, 13, 14]])
    assert packed_targets(packed, labels)[row].tolist() == [13, 14, IGNORE_INDEX, 11, IGNORE_INDEX]
    with pytest.raises(ValueError, match="packed labels must have the packed rows' shape"):
        packed_targets(packed, labels[:, :3])


def test_short_rows_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="shorter than sequence_parallel_size = 4"):
        shard_packed(pack_lists([[1, 2]], pad_id=0), 0, 4)


def test_core_mask_uses_a_whole_row_mask_and_refuses_a_local_one() -> None:
    seg = torch.tensor([[0, 0, 1, 1]])
    additive = block_causal_mask(seg)
    got = core_mask(additive, 4, torch.float32, torch.device("cpu"), additive=True)
    assert torch.equal(got, additive)
    allowed = additive == 0
    assert torch.equal(core_mask(allowed, 4, torch.float32, torch.device("cpu"), additive=False), allowed)
    assert torch.equal(core_mask(allowed, 4, torch.float32, torch.device("cpu"), additive=True), additive)
    assert torch.equal(
        core_mask(None, 4, torch.float32, torch.device("cpu"), additive=True),
        causal_mask(4, torch.float32, torch.device("cpu"), True),
    )
    with pytest.raises(ValueError, match=r"must be 4D \[batch, 1, 4, 4\]"):
        core_mask(additive[:, :, :2], 4, torch.float32, torch.device("cpu"), additive=True)
