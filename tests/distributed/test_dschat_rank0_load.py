"""DeepSpeed-Chat's step-3 critic load on hybridzero: only rank 0 writes the checkpoint, the engine agrees.

DeepSpeed-Chat builds the critic with weight init skipped (``no_init_weights``: every rank's values are whatever
memory held) under an ``HfDeepSpeedConfig`` (hybridzero's registers nothing, so the model is whole on every rank),
then loads the checkpoint module by module inside ``GatheredParameters(params, modifier_rank=0)`` with only rank 0
calling ``_load_from_state_dict``, and only afterwards calls ``deepspeed.initialize``. For parameters nobody owns
yet the block is a no-op, so rank 1 still holds garbage when ``initialize`` runs. The invariant checked here: the
engine every rank gets holds rank 0's values (``initialize`` broadcasts them), bit for bit, and forwards agree.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.harness.parity import RunSpec, build_model, ds_config


def _rank0_loads(model: nn.Module, state: dict[str, torch.Tensor], rank: int) -> None:
    """The pattern of DeepSpeed-Chat's ZeRO-3 checkpoint load, written here: per module, its own parameters in
    one ``GatheredParameters(modifier_rank=0)`` block in which rank 0 alone copies the checkpoint's values."""
    import hybridzero as deepspeed

    for prefix, module in model.named_modules():
        own = dict(module.named_parameters(prefix=prefix, recurse=False))
        if not own:
            continue
        with deepspeed.zero.GatheredParameters(list(own.values()), modifier_rank=0), torch.no_grad():
            if rank == 0:
                for name, param in own.items():
                    param.copy_(state[name])


def rank0_load_then_initialize() -> dict[str, Any]:
    """Per rank: garbage values (NaN on rank 1, as memory left uninitialised may hold), rank 0 loads a checkpoint
    of another seed, then stage-3 ``initialize``. Returns the engine's full parameters and a forward's logits."""
    import hybridzero as deepspeed
    from hybridzero.runtime.hf_ds_config import HfDeepSpeedConfig

    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    spec = RunSpec(model="opt", stage=3, persistence_threshold=0)
    config = ds_config(spec, world)
    assert HfDeepSpeedConfig(config).is_zero3()  # what create_hf_model builds first; registers nothing
    model = build_model(spec)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan") if rank else 0.0)
    checkpoint = build_model(RunSpec(model="opt", seed=7)).state_dict()
    _rank0_loads(model, checkpoint, rank)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=torch.arange(2, 10).view(1, 8)).logits
    return {"params": engine.full_parameters(), "logits": logits}


def test_rank0_only_checkpoint_load_before_initialize_reaches_every_rank(world: Any) -> None:
    """Every rank's engine equals the checkpoint exactly (rank 1's NaN never survives), and the logits agree."""
    results = world(2).run(rank0_load_then_initialize)
    want = build_model(RunSpec(model="opt", seed=7)).state_dict()
    for rank, res in enumerate(results):
        assert set(res["params"]) <= set(want), rank
        for name, value in res["params"].items():
            assert torch.equal(value.float(), want[name].float()), (rank, name)
        assert torch.isfinite(res["logits"]).all(), rank
    assert torch.equal(results[0]["logits"], results[1]["logits"])
