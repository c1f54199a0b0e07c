"""Pure pieces of tensor-parallel generation: the slicing math (column / row splits reassemble the whole product),
the joint batch (left padding, rows back at their own width and EOS length, HF's default mask), the family plans'
refusals, and the request checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridzero.runtime.tp_batch import default_attention_mask, join_rows, own_rows, pad_left
from hybridzero.runtime.tp_generate import _mismatch, request_problem, tp_groups
from hybridzero.runtime.tp_layers import column_rows, column_slice, local_clone, row_slice
from hybridzero.runtime.tp_plans import family_of
from tests.harness.models import tiny_llama, tiny_opt


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_then_row_split_reassembles_the_whole_product(tp: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x, w1, b1, w2 = (torch.randn(s, generator=gen) for s in ((3, 7), (12, 7), (12,), (5, 12)))
    whole = F.linear(F.relu(F.linear(x, w1, b1)), w2)
    parts = []
    for r in range(tp):
        w, b = column_slice(w1, b1, r, tp)
        parts.append(F.linear(F.relu(F.linear(x, w, b)), row_slice(w2, r, tp)))
    torch.testing.assert_close(sum(parts), whole, rtol=1e-6, atol=1e-6)


def test_fused_chunks_take_each_chunks_share() -> None:
    assert column_rows(12, 1, 2, chunks=3).tolist() == [2, 3, 6, 7, 10, 11]  # q|k|v of 4 rows each, rank 1 of 2
    assert column_rows(8, 0, 4).tolist() == [0, 1]


def test_joint_batch_rows_come_back_at_their_own_width_and_eos_length() -> None:
    ids = torch.tensor([[5, 6], [7, 8]])
    padded = pad_left(ids, 4, 3, 0)
    assert padded.tolist() == [[0, 0, 5, 6], [0, 0, 7, 8], [0, 0, 0, 0]]
    gathered = torch.arange(12).view(6, 2)  # two ranks, Bmax 3: rank 0 has 2 rows, rank 1 has 1
    assert join_rows(gathered, [2, 1]).tolist() == [[0, 1], [2, 3], [6, 7]]
    # joint output width 4 + 4 new tokens; this rank's rows 1..2 had width 2; EOS = 9
    joint = torch.tensor(
        [
            [1, 1, 1, 1, 3, 3, 3, 3],
            [0, 0, 5, 6, 4, 9, 0, 0],
            [0, 0, 7, 8, 9, 0, 0, 0],
        ]
    )
    assert own_rows(joint, 1, 3, 4, 2, [9]).tolist() == [[5, 6, 4, 9], [7, 8, 9, 0]]
    assert own_rows(joint, 0, 1, 4, 4, [9]).tolist() == [[1, 1, 1, 1, 3, 3, 3, 3]]  # no EOS: every token
    assert own_rows(joint, 1, 3, 4, 2, []).shape == (2, 6)


def test_default_mask_follows_hf_rule() -> None:
    ids = torch.tensor([[0, 4, 5]])
    assert default_attention_mask(ids, 0, [2]).tolist() == [[0, 1, 1]]
    assert default_attention_mask(ids, 0, [0]).tolist() == [[1, 1, 1]]  # pad == eos: no inference
    assert default_attention_mask(ids, None, []).tolist() == [[1, 1, 1]]


def test_families_refuse_unknown_types_and_indivisible_sizes_by_name() -> None:
    with pytest.raises(ValueError, match="num_attention_heads = 5, num_key_value_heads = 1, intermediate_size = 67"):
        family_of(tiny_llama(0), 2)
    assert (
        family_of(
            tiny_llama(
                0, hidden_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=10, intermediate_size=68
            ),
            2,
        ).name
        == "llama"
    )
    with pytest.raises(ValueError, match="ffn_dim"):
        family_of(tiny_opt(0), 5)  # 5 heads divide, ffn 48 does not

    class Other(nn.Module):
        config = type("C", (), {"model_type": "bloom"})()

    with pytest.raises(ValueError, match=r"supports the model types gpt2, llama, opt; Other has model_type 'bloom'"):
        family_of(Other(), 2)


def test_local_clone_keeps_the_original_and_copies_parameters() -> None:
    norm = nn.LayerNorm(3)
    clone = local_clone(norm, copy_params=True)
    assert type(clone) is nn.LayerNorm and not list(clone.parameters())
    assert torch.equal(clone.weight, norm.weight) and clone.weight.data_ptr() != norm.weight.data_ptr()
    with pytest.raises(TypeError, match="holds parameter 'weight'"):
        local_clone(norm)
    attn = nn.Module()
    attn.q = nn.Linear(2, 2)
    attn.heads = 4
    swapped = local_clone(attn, {"q": nn.Identity()}, {"heads": 2})
    assert (
        isinstance(swapped.q, nn.Identity) and swapped.heads == 2 and attn.heads == 4 and isinstance(attn.q, nn.Linear)
    )


def test_request_checks_and_group_agreement() -> None:
    assert request_problem({"max_new_tokens": 3, "attention_mask": torch.ones(1)}, None, 2) is None
    assert "num_beams=4" in str(request_problem({"num_beams": 4}, None, 2))
    assert "stopping_criteria" in str(request_problem({"stopping_criteria": [object()]}, None, 2))
    assert "max_gathered_bytes" in str(request_problem({}, 10, 2))
    assert "position_ids=<tensor>" in str(request_problem({"position_ids": torch.ones(1)}, None, 2))
    assert tp_groups(4, 2) == [[0, 1], [2, 3]]
    same = (1, 4, {"max_new_tokens": "3"}, False)
    assert _mismatch([same, same, same, (2, 9, {"max_new_tokens": "3"}, True)], 2) is None  # shapes may differ
    err = _mismatch([same, same, same, (1, 4, {"max_new_tokens": "4"}, False)], 2)
    assert err is not None and "'max_new_tokens' differs within a group (rank 2: 3, rank 3: 4)" in str(err)
