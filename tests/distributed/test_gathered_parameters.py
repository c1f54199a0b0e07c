"""``GatheredParameters`` with a modifier rank changes the trained model exactly as the same change made to the
reference; without a modifier, changes are discarded; pinned groups survive a forward inside the block."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_zero3_parity import compare
from tests.harness.parity import RunSpec, build_model, ds_config, engine_run, reference_run

EDITS = ("model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight", "model.norm.weight")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [3, 2, 0])
def test_modifier_rank_edit_matches_reference(world, world_size: int, stage: int) -> None:
    spec = RunSpec(model="llama", steps=3, stage=stage, edit=EDITS, persistence_threshold=50)
    compare(world(world_size).run(engine_run, spec), reference_run(spec, world_size))


def _edit_without_modifier_raises() -> tuple[bool, bool, bool, bool]:
    import hybridzero

    hybridzero.init_distributed()
    spec = RunSpec(model="gpt2_tied")
    engine, *_ = hybridzero.initialize(
        model=build_model(spec), config=ds_config(spec, torch.distributed.get_world_size())
    )
    weight = engine.module.get_parameter("transformer.h.0.mlp.c_fc.weight")
    before = engine.full_parameters()["transformer.h.0.mlp.c_fc.weight"]
    ids = torch.randint(0, 90, (2, 6))
    raised = False
    try:
        with engine.gathered_parameters([weight]), torch.no_grad():
            full_inside = weight.shape == before.shape and torch.equal(weight, before)
            weight.fill_(float(torch.distributed.get_rank()))  # edits differ by rank (identical ones are kept)
            engine(input_ids=ids)  # the block's post-forward must not release a pinned group
            still_pinned = weight.numel() == before.numel()
    except RuntimeError as exc:
        raised = "modifier_rank" in str(exc)
    engine.assert_quiescent()
    after = engine.full_parameters()["transformer.h.0.mlp.c_fc.weight"]
    return full_inside, still_pinned, raised, torch.equal(after, before)


def test_edit_without_modifier_raises_on_every_rank_and_is_undone(world) -> None:
    """Every rank edits without a modifier rank, each differently: every rank raises (DeepSpeed's sanity check, never a
    silent discard) and the master is untouched."""
    assert world(2).run(_edit_without_modifier_raises) == [(True, True, True, True)] * 2
