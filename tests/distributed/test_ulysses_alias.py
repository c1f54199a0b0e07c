"""DeepSpeed's ALST/Ulysses API through the ``deepspeed`` alias at world 2 (s = 2, dp = 1), against s = 1 at world 2
(dp = 2) on the same global batches (tests/workers/ulysses_alias.py has the model and data):

* ``UlyssesSPAttentionHF.register_with_transformers`` switches the model to hybridzero's Ulysses attention and
  returns the mpu ``deepspeed.initialize(mpu=...)`` accepts; ``engine.destroy()`` gives the model its SDPA back and
  forgets the registration;
* with ``disable_in_eval=True`` (Trainer's default) a model in eval mode runs whole rows with plain causal
  attention, giving the unregistered model's logits;
* ``UlyssesSPDataLoaderAdapter`` yields, per loader batch of each rank, this rank's half of every row (13 tokens
  right-padded to 14: 7 each), global ``position_ids`` and ``shift_labels`` instead of ``labels``; its length is
  twice the loader's;
* ``deepspeed.utils.groups``' getters report the SP group (size 2, the mpu's group) and the data-parallel group
  (size 1); without a registration, no SP (size 1) and the world;
* the losses -- Hugging Face's own SP aggregation (``deepspeed_sp_compute_loss``: each slice's token mean weighted
  by its token count over the SP group) -- equal the s = 1 losses of the same batches through 3 SGD steps, each
  step two micro-batches (s = 2, accumulation 2) against two ranks' one (s = 1, dp 2).

Tolerance 1e-5 relative: the forward is the same arithmetic (the all-to-alls move values; SDPA on CPU computes
each head alone) except that a loss is (mean of slice 0 x n0 + mean of slice 1 x n1) / n instead of one mean over
n <= 24 tokens, a reassociation bounded by ~n u = 24 x 6e-8 = 1.4e-6 relative; the gradients reassociate the same
way at each of the ~10 summations of the backward chain, and SGD carries those ~1e-6 relative weight differences
linearly into the next steps' losses (3 steps, lr 0.1, tiny weights): well under 1e-5.
"""

from __future__ import annotations

import torch

from tests.conftest import WorldFactory
from tests.workers.ulysses_alias import (
    SEQ,
    STEPS,
    ds_named_packed_run,
    ds_named_run,
    loader_batches,
    packed_reference,
    reference_run,
    state_module_run,
)


def test_deepspeed_named_ulysses_matches_s1(world: WorldFactory) -> None:
    pool = world(2)
    ref = pool.run(reference_run, timeout=300)
    got = pool.run(ds_named_run, timeout=300)
    want = [ref[rank]["losses"][t] for t in range(STEPS) for rank in range(2)]  # micro j = rank j's batch
    assert want[0] != want[-1]  # it trains
    for rank, r in enumerate(got):
        assert r["len"] == 2 * STEPS and len(r["losses"]) == 2 * STEPS, r
        for g, w in zip(r["losses"], want, strict=True):
            assert abs(g - w) <= 1e-5 * abs(w), (rank, r["losses"], want)
        assert r["impl_during"].startswith("hybridzero_ulysses_") and r["impl_after"] == "sdpa", r
        assert r["after_destroy"] == 1
        assert r["eval_diff"] <= 1e-5, r["eval_diff"]  # disable_in_eval: the whole row, same kernel, same order
        assert r["before"]["sp"] == (1, 0) and r["before"]["dp"] == (2, rank), r["before"]
        probe = r["probe"]
        assert probe["sp"] == (2, rank) and probe["mpu"] == (2, rank) and probe["same_group"], probe
        assert probe["dp"] == (1, 0) and probe["sdp"] == (2, rank), probe
        local = (SEQ + 1) // 2
        assert r["shapes"] == [(2, local)] * (2 * STEPS)
        first = r["first"]
        assert "labels" not in first and set(first) >= {"input_ids", "position_ids", "shift_labels"}, first.keys()
        whole = loader_batches(0, 2)[0]  # micro-batch 0 is rank 0's first batch
        lo, hi = rank * local, (rank + 1) * local
        padded_ids = torch.nn.functional.pad(whole["input_ids"], (0, 1), value=0)
        assert torch.equal(first["input_ids"], padded_ids[:, lo:hi])
        assert torch.equal(first["position_ids"], torch.arange(lo, hi).expand(2, -1))
        shifted = torch.full((2, SEQ + 1), -100)
        shifted[:, : SEQ - 1] = whole["labels"][:, 1:]
        assert torch.equal(first["shift_labels"], shifted[:, lo:hi])


def test_parallel_state_sp_module_as_the_mpu(world: WorldFactory) -> None:
    """DeepSpeed's other spelling: groups first (``initialize_sequence_parallel``), the module as the mpu; the engine
    switches the model, the loss of rank 0's first batch is the s = 1 one; a second registration is refused; destroy
    forgets the groups."""
    pool = world(2)
    want = pool.run(reference_run, timeout=300)[0]["losses"][0]
    for r in pool.run(state_module_run, timeout=300):
        assert r["again"].startswith("Ulysses sequence parallelism is already registered in this process"), r
        assert r["impl"].startswith("hybridzero_ulysses_") and r["sizes"] == (2, 1) and r["after"] == 0, r
        assert abs(r["loss"] - want) <= 1e-5 * abs(want), (r["loss"], want)


def test_packed_rows_through_the_adapter_match_unpacked(world: WorldFactory) -> None:
    """Packed loader batches (``DataCollatorWithFlattening``'s layout: positions restarting inside a row) through
    ``UlyssesSPDataLoaderAdapter`` at s = 2 give each micro-batch's unpacked s = 1 loss (every sequence forwarded
    alone), tolerance 1e-5 as above: the block-causal mask excludes exactly the keys the sequences lack alone."""
    for r in world(2).run(ds_named_packed_run, timeout=300):
        want = [packed_reference(0), packed_reference(1)]
        for g, w in zip(r["losses"], want, strict=True):
            assert abs(g - w) <= 1e-5 * abs(w), (r["losses"], want)
