"""Per-rank bodies of tests/distributed/test_deepspeed_api.py: DeepSpeed's engine-free API, the engine as a module
(its ZeRO-3 parameter attributes and ``unwrap_model_for_generation``: :mod:`tests.workers.dropin_zero3`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from hybridzero import utils
from hybridzero.zero.registry import REGISTRY
from tests.harness.parity import RunSpec, batches_for, build_model, ds_config

FRAGMENT_PARAMS = (
    "model.layers.1.mlp.up_proj.weight",
    "model.embed_tokens.weight",
    "model.norm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.input_layernorm.weight",
)


def _setup(spec: RunSpec) -> tuple[Any, torch.Tensor, int, int]:
    import hybridzero as deepspeed

    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    model = build_model(spec)
    batches = batches_for(spec, world, int(model.config.vocab_size))
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(spec, world))
    return engine, batches, rank, world


def fragments_run(spec: RunSpec, edit_via: str) -> dict[str, Any]:
    """Train ``spec`` with the engine-free API only: after step 0 the parameters ``spec.edit`` become ``0.5 x + 0.01``
    through ``zero.GatheredParameters(modifier_rank=0)`` (``edit_via="gathered"``) or
    ``utils.safe_set_full_fp32_param`` (``"safe_set"``). Records the full gradients of ``FRAGMENT_PARAMS`` at every
    boundary (before ``step``), their local parts, exp_avg after step 0, and the final values via
    ``safe_get_full_fp32_param``."""
    import hybridzero as deepspeed

    engine, batches, rank, _ = _setup(spec)
    named = dict(engine.module.named_parameters())
    watched = [n for n in FRAGMENT_PARAMS if n in named]
    losses, grads, local_grads = [], [], []
    exp_avg: dict[str, Any] = {}
    for s in range(spec.steps):
        step_losses = []
        for m in range(spec.accumulation):
            ids = batches[s, m, rank]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():
                grads.append({n: utils.safe_get_full_grad(named[n]) for n in watched})
                local_grads.append({n: utils.safe_get_local_grad(named[n]) for n in watched})
            engine.step()
            step_losses.append(loss.item())
        losses.append(step_losses)
        if s == 0:
            exp_avg = {
                n: (
                    utils.safe_get_full_optimizer_state(named[n], "exp_avg"),
                    utils.safe_get_local_optimizer_state(named[n], "exp_avg"),
                )
                for n in watched
            }
            _edit(deepspeed, utils, [named[n] for n in spec.edit], rank, edit_via)
            engine.assert_quiescent()
    full = engine.full_parameters()  # frozen parameters have no fp32 state: safe_get_*_fp32_param gives None
    fp32 = {n: utils.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    assert all((fp32[n] is None) == (not p.requires_grad) for n, p in engine.module.named_parameters())
    params = {n: full[n] if v is None else v for n, v in fp32.items()}
    local = {n: utils.safe_get_local_fp32_param(named[n]) for n in watched}
    return {
        "losses": losses,
        "params": params if rank == 0 else None,
        "lr": engine.get_lr(),
        "grads": grads,
        "local_grads": local_grads,
        "exp_avg": exp_avg,
        "local_params": local,
        "final": {n: params[n] for n in watched},
    }


def _edit(deepspeed: Any, utils: Any, targets: list[torch.Tensor], rank: int, edit_via: str) -> None:
    if edit_via == "gathered":
        with deepspeed.zero.GatheredParameters(targets, modifier_rank=0), torch.no_grad():
            for t in targets:
                if rank == 0:
                    t.mul_(0.5).add_(0.01)
                else:
                    t.zero_()  # discarded: rank 0's values are broadcast
    else:
        for t in targets:
            utils.safe_set_full_fp32_param(t, utils.safe_get_full_fp32_param(t).mul(0.5).add(0.01))


def set_state_roundtrip(spec: RunSpec) -> dict[str, bool]:
    """``safe_set_full_optimizer_state`` / ``safe_set_local_*`` write exactly what the getters then return."""
    engine, batches, rank, _ = _setup(spec)
    ids = batches[0, 0, rank]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    p = engine.module.get_parameter(FRAGMENT_PARAMS[0])
    shape = utils.safe_get_full_fp32_param(p).shape  # p itself is a placeholder at ZeRO-3
    want = torch.arange(shape.numel(), dtype=torch.float32).reshape(shape) / 7
    utils.safe_set_full_optimizer_state(p, want, "exp_avg")
    full_ok = torch.equal(utils.safe_get_full_optimizer_state(p, "exp_avg"), want)
    local = utils.safe_get_local_optimizer_state(p, "exp_avg")
    utils.safe_set_local_optimizer_state(p, local * 2, "exp_avg")
    local_ok = torch.equal(utils.safe_get_full_optimizer_state(p, "exp_avg"), want * 2)
    fp32 = utils.safe_get_local_fp32_param(p)
    utils.safe_set_local_fp32_param(p, fp32 + 1)
    with torch.no_grad():
        whole = engine.full_parameters()[FRAGMENT_PARAMS[0]]
    fp32_ok = torch.equal(utils.safe_get_full_fp32_param(p), whole)
    try:
        utils.safe_get_full_optimizer_state(p, "no_such_key")
        key_error = ""
    except KeyError as exc:
        key_error = str(exc)
    return {"full": full_ok, "local": local_ok, "fp32": fp32_ok, "key_error": "exp_avg_sq" in key_error}


def edit_without_modifier(spec: RunSpec, editors: tuple[int, ...]) -> dict[str, Any]:
    """Ranks in ``editors`` change a parameter inside ``zero.GatheredParameters`` without a modifier rank: every
    rank must raise, and the values (and the next loss) must be unchanged on every rank."""
    import hybridzero as deepspeed

    engine, batches, rank, _ = _setup(spec)
    targets = [engine.module.get_parameter(n) for n in spec.edit]
    before = [utils.safe_get_full_fp32_param(t) for t in targets]
    ids = batches[0, 0, rank]
    with torch.no_grad():
        loss_before = engine(input_ids=ids, labels=ids).loss.item()
    message = ""
    try:
        with deepspeed.zero.GatheredParameters(targets), torch.no_grad():
            if rank in editors:
                targets[0].add_(1.0 + rank)  # edits differ by rank (an identical edit on every rank is kept)
    except RuntimeError as exc:
        message = str(exc)
    engine.assert_quiescent()
    after = [utils.safe_get_full_fp32_param(t) for t in targets]
    with torch.no_grad():
        loss_after = engine(input_ids=ids, labels=ids).loss.item()
    return {
        "raised": "modifier_rank" in message and str(list(editors)) in message,
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
        "loss_same": loss_before == loss_after,
    }


def unowned_and_two_engines() -> dict[str, Any]:
    """Before ``initialize`` the block is a no-op; parameters of two engines in one call are gathered and edited
    owner by owner."""
    import hybridzero as deepspeed

    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    plain = build_model(RunSpec(model="gpt2_tied"))
    w = plain.get_parameter("transformer.h.0.mlp.c_fc.weight")
    with deepspeed.zero.GatheredParameters([w]), torch.no_grad():
        w.fill_(0.25)  # nobody owns it: plain tensor, nothing to check or undo
    unowned = bool(torch.all(w == 0.25)) and utils.safe_get_full_fp32_param(w) is None
    engines = []
    for name in ("gpt2_tied", "opt"):
        spec = RunSpec(model=name)
        engine, *_ = deepspeed.initialize(model=build_model(spec), config=ds_config(spec, world))
        engines.append(engine)
    a = engines[0].module.get_parameter("transformer.h.1.mlp.c_proj.weight")
    b = engines[1].module.get_parameter("model.decoder.layers.0.fc1.weight")
    with deepspeed.zero.GatheredParameters([a, b], modifier_rank=0), torch.no_grad():
        full_inside = a.dim() == 2 and b.dim() == 2 and a.numel() > 0 and b.numel() > 0
        if rank == 0:
            a.fill_(1.5)
            b.fill_(-2.0)
    for e in engines:
        e.assert_quiescent()
    edited = bool(
        torch.all(utils.safe_get_full_fp32_param(a) == 1.5) and torch.all(utils.safe_get_full_fp32_param(b) == -2.0)
    )
    return {"unowned": unowned, "full_inside": full_inside, "edited": edited}


def module_surface(spec: RunSpec) -> dict[str, Any]:
    """The engine as DeepSpeed's ``nn.Module``: names, counts, state dicts, fall-through, the batch getters, and a
    ``load_state_dict`` whose next forward equals the plain model's."""
    import hybridzero as deepspeed

    engine, batches, rank, world = _setup(spec)
    plain = build_model(spec)
    plain_sd = plain.state_dict()
    sd = engine.state_dict()
    msd = engine.module_state_dict()
    ids = batches[0, 0, rank]
    out: dict[str, Any] = {
        "is_module": isinstance(engine, torch.nn.Module),
        "sd_keys": list(sd) == ["module." + k for k in plain_sd],
        "sd_values": all(torch.equal(sd["module." + k], v) for k, v in plain_sd.items()),
        "msd_values": list(msd) == list(plain_sd) and all(torch.equal(msd[k], v) for k, v in plain_sd.items()),
        "param_names": [n for n, _ in engine.named_parameters()]
        == ["module." + n for n, _ in plain.named_parameters()],
        "n_params": len(list(engine.parameters())) == len(list(plain.parameters())),
        "submodules": [n for n, _ in engine.named_children()] == ["module"],
        "buffers": [n for n, _ in engine.named_buffers()] == ["module." + n for n, _ in plain.named_buffers()],
        "fallthrough": engine.get_input_embeddings() is engine.module.get_input_embeddings(),
        "own_config": engine.config is not engine.module.config,
        "batch": (
            engine.train_batch_size(),
            engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps(),
            engine.zero_optimization_stage(),
            engine.world_size,
            engine.global_rank == rank,
            engine.fp16_enabled(),
            engine.bfloat16_enabled(),
        ),
    }
    engine.eval()
    out["eval"] = not engine.training and not engine.module.training
    engine.train()
    out["train"] = engine.training and engine.module.training
    new = {k: (v * 0.5 + 0.01 if v.is_floating_point() else v) for k, v in sd.items()}
    result = engine.load_state_dict(new)
    plain.load_state_dict({k[len("module.") :]: v for k, v in new.items()})
    with torch.no_grad():
        got, want = engine(input_ids=ids, labels=ids).loss, plain(input_ids=ids, labels=ids).loss
    out["load"] = (list(result.missing_keys), list(result.unexpected_keys), bool(torch.equal(got, want)))
    engine.assert_quiescent()
    engine.empty_partition_cache()
    engine.assert_quiescent()
    w = engine.module.get_parameter("transformer.h.0.mlp.c_fc.weight")
    owned = REGISTRY.owner_of(w) is engine.param_owner
    engine.destroy()
    with deepspeed.zero.GatheredParameters([w], modifier_rank=0):  # nobody owns it any more: a no-op
        out["destroyed_noop"] = (
            owned and REGISTRY.owner_of(w) is None and w.numel() == (0 if spec.stage == 3 else 35 * 48)
        )
    out["world"] = world
    return out


def comm_face() -> dict[str, Any]:
    """``hybridzero.comm`` as ``deepspeed.comm``: ranks and a sum all-reduce."""
    import hybridzero as deepspeed

    deepspeed.init_distributed()
    dist = deepspeed.comm
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([float(dist.get_rank())]))
    b = torch.tensor([7.0 if dist.get_rank() == 0 else 0.0])
    dist.broadcast(b, 0)
    dist.barrier()
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": t.item(),
        "local": dist.get_local_rank(),
        "gathered": [g.item() for g in gathered],
        "bcast": b.item(),
        "init": dist.is_initialized(),
    }


def initialize_with_args(tmp: str) -> dict[str, Any]:
    """``initialize(args=...)`` with ``--deepspeed_config`` from ``add_config_arguments``; DeepSpeed's errors."""
    import hybridzero as deepspeed

    deepspeed.init_distributed()
    world = deepspeed.comm.get_world_size()
    spec = RunSpec(model="gpt2_tied")
    path = Path(tmp) / f"ds_{deepspeed.comm.get_rank()}.json"
    path.write_text(json.dumps(ds_config(spec, world)))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    engine, opt, loader, sched = deepspeed.initialize(args=args, model=build_model(spec), model_parameters=None)
    out: dict[str, Any] = {
        "args": (args.deepspeed, args.deepscale, args.deepscale_config),
        "tuple": (opt is engine.optimizer, loader is None, sched is None),
        "micro": engine.train_micro_batch_size_per_gpu(),
    }
    errors = []
    for kwargs in (
        {"args": args, "config": ds_config(spec, world)},
        {"config": ds_config(spec, world), "mpu": object()},
        {},
    ):
        try:
            deepspeed.initialize(model=build_model(spec), **kwargs)
            errors.append("")
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = [("both" in errors[0]), ("mpu" in errors[1]), ("deepspeed_config" in errors[2])]
    return out


def client_scheduler_object(stage: int) -> dict[str, Any]:
    """DeepSpeed-Chat's pattern: a scheduler object built on the client optimizer, both handed to ``initialize``.
    Three steps with every warning an error; returns the lrs the torch optimizer behind the engine saw."""
    import warnings

    import hybridzero

    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    spec = RunSpec(model="opt", stage=stage)
    model = build_model(spec)
    client = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(client, lambda s: 1.0 / (s + 1))
    config = {k: v for k, v in ds_config(spec, world).items() if k not in ("optimizer", "scheduler")}
    engine, optimizer, _, scheduler = hybridzero.initialize(
        model=model, optimizer=client, lr_scheduler=schedule, config=config
    )
    batches = batches_for(spec, world, int(model.config.vocab_size))
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for s in range(3):
            ids = batches[s, 0, rank]
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            lrs.append(optimizer.param_groups[0]["lr"])
    return {"same_scheduler": scheduler is schedule, "lrs": lrs}
