"""Two patterns of DeepSpeed-Chat's own code that its unedited step 3 relies on, checked without its code.

**Rank-0 load** (the critic and reward models): DeepSpeed-Chat builds the model with weight init skipped
(``no_init_weights``: values are whatever memory held), loads the checkpoint module by module inside
``GatheredParameters(params, modifier_rank=0)`` with only rank 0 calling ``_load_from_state_dict``, and only then calls
``deepspeed.initialize``. Checked here when the model is built whole (hybridzero's ``HfDeepSpeedConfig`` registers
nothing): the block is a no-op for parameters nobody owns, rank 1 still holds garbage at ``initialize``, and every
rank's engine must hold rank 0's values (``initialize`` broadcasts them), bit for bit.

**EMA at ZeRO-3** (``--enable_ema``): for each pair of parameters of the actor and its EMA copy (two engines) it
gathers both without a modifier rank and writes ``ema.data.copy_(torch.lerp(p.data, ema.data, beta))`` on every
rank. The same edit on every rank is kept (as with ``modifier_rank=0``); DeepSpeed drops it silently.
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


def ema_update_without_modifier(beta: float) -> dict[str, Any]:
    """Two stage-3 engines (actor: seed 0, EMA copy: seed 7); DeepSpeed-Chat's EMA loop over their parameter pairs,
    each pair gathered in one block without a modifier. Returns the EMA engine's full parameters after it."""
    import hybridzero as deepspeed

    deepspeed.init_distributed()
    world = deepspeed.comm.get_world_size()
    engines = []
    for seed in (0, 7):
        spec = RunSpec(model="opt", stage=3, persistence_threshold=0, seed=seed)
        engine, *_ = deepspeed.initialize(model=build_model(spec), config=ds_config(spec, world))
        engines.append(engine)
    actor, ema = engines
    with torch.no_grad():
        for param, param_ema in zip(actor.module.parameters(), ema.module.parameters()):
            with deepspeed.zero.GatheredParameters([param, param_ema]):
                param_ema.data.copy_(torch.lerp(param.data, param_ema.data, beta))
    actor.assert_quiescent()
    ema.assert_quiescent()
    return {"ema": ema.full_parameters()}


def test_ema_update_made_identically_on_every_rank_is_kept(world: Any) -> None:
    """The EMA engine ends with ``lerp(actor, ema, beta)`` of the unsharded twins on every rank (no error, no
    silent discard)."""
    beta = 0.75
    results = world(2).run(ema_update_without_modifier, beta)
    actor = build_model(RunSpec(model="opt", seed=0)).state_dict()
    ema = build_model(RunSpec(model="opt", seed=7)).state_dict()
    for rank, res in enumerate(results):
        assert res["ema"], rank
        for name, value in res["ema"].items():
            want = torch.lerp(actor[name].float(), ema[name].float(), beta)
            assert torch.allclose(value.float(), want, atol=1e-6), (rank, name)
            if not torch.equal(actor[name], ema[name]):  # (norms start equal in both)
                assert not torch.equal(value.float(), ema[name].float()), (rank, name)
