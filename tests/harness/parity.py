"""Run the same training on the sharded engine (one call per rank) and on one unsharded process.

Semantics both sides share: a step consumes ``accumulation × world`` micro-batches; the loss of a step is the mean
of the micro-batch losses; the gradient is the gradient of that mean. Rank ``r`` at micro-step ``m`` of step ``s``
uses ``batches[s, m, r]``; the reference walks the same tensor.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tests.harness.data import make_token_batches
from tests.harness.models import MODEL_FACTORIES, WithScalar


@dataclass(frozen=True)
class RunSpec:
    """One training run, identical on the engine and the reference."""

    model: str = "llama"
    steps: int = 3
    accumulation: int = 1
    micro_batch: int = 2
    seq_len: int = 9
    lr: float = 1e-2
    clipping: float = 0.0
    optimizer: str = "config"  # "config" (DeepSpeed block) or "client" (torch optimizer built by the user)
    optimizer_type: str = "AdamW"
    scheduler: bool | str = False  # True: WarmupDecayLR; "OneCycle": that schedule (lr and beta1 cycled)
    dtype: str = "fp32"
    prefetch_bucket_size: int = 0
    persistence_threshold: int = 0
    with_scalar: bool = False
    overlap_comm: bool = False
    reduce_bucket_size: int = 500_000_000
    seed: int = 0
    stage: int = 3
    inf_at: tuple[tuple[int, int], ...] = ()  # (step, rank) pairs: that rank's loss becomes inf (step overflows)
    fp16: dict[str, Any] = field(default_factory=dict)  # extra keys of the fp16 block
    edit: tuple[str, ...] = ()  # parameters changed (x -> 0.5 x + 0.01) on rank 0 via GatheredParameters after step 0
    frozen: tuple[str, ...] = ()  # parameters whose name contains one of these are frozen
    extra_zero: dict[str, Any] = field(default_factory=dict)
    lora: tuple[str, int, bool] | None = None  # (module-name substring, lora_dim, only_optimize_lora): DS-Chat LoRA
    activation_checkpointing: bool = False  # HF's non-reentrant gradient checkpointing (engine and reference alike)

    def replace(self, **changes: Any) -> RunSpec:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def build_model(spec: RunSpec) -> nn.Module:
    """The spec's tiny model, deterministically initialised."""
    model = MODEL_FACTORIES[spec.model](seed=spec.seed)
    if spec.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.lora is not None:
        from hybridzero.lora import convert_linear_layer_to_lora, only_optimize_lora

        part, dim, only = spec.lora
        convert_linear_layer_to_lora(model, part, dim, seed=spec.seed)
        if only:
            only_optimize_lora(model)
    model = WithScalar(model) if spec.with_scalar else model
    for name, param in model.named_parameters():
        if any(part in name for part in spec.frozen):
            param.requires_grad_(False)
    return model


def batches_for(spec: RunSpec, world_size: int, vocab_size: int) -> torch.Tensor:
    """``[steps, accumulation, world, micro, seq]`` token ids."""
    return make_token_batches(
        spec.seed + 1,
        steps=spec.steps,
        accumulation=spec.accumulation,
        world_size=world_size,
        micro_batch=spec.micro_batch,
        seq_len=spec.seq_len,
        vocab_size=vocab_size,
    )


def ds_config(spec: RunSpec, world_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON config of the spec."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": spec.accumulation,
        "train_batch_size": spec.micro_batch * spec.accumulation * world_size,
        "gradient_clipping": spec.clipping,
        "zero_optimization": {
            "stage": spec.stage,
            "stage3_prefetch_bucket_size": spec.prefetch_bucket_size,
            "stage3_param_persistence_threshold": spec.persistence_threshold,
            "overlap_comm": spec.overlap_comm,
            "reduce_bucket_size": spec.reduce_bucket_size,
            **spec.extra_zero,
        },
        "bf16": {"enabled": spec.dtype == "bf16"},
        "fp16": {"enabled": spec.dtype == "fp16", **spec.fp16},
    }
    if spec.optimizer == "config":
        cfg["optimizer"] = {"type": spec.optimizer_type, "params": {"lr": spec.lr, "weight_decay": 0.01}}
    if spec.scheduler == "OneCycle":
        cfg["scheduler"] = {
            "type": "OneCycle",
            "params": {
                "cycle_min_lr": spec.lr / 10,
                "cycle_max_lr": spec.lr,
                "cycle_first_step_size": 2,
                "cycle_second_step_size": 1,
                "decay_step_size": 1,
                "decay_lr_rate": 0.5,
                "cycle_min_mom": 0.85,
                "cycle_max_mom": 0.95,
            },
        }
    elif spec.scheduler:
        cfg["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": spec.lr,
                "warmup_num_steps": 2,
                "total_num_steps": spec.steps + 2,
                "warmup_type": "linear",
            },
        }
    return cfg


def client_optimizer(spec: RunSpec, model: nn.Module) -> torch.optim.Optimizer:
    """A user's torch optimizer over the full model: two param groups (no decay for 1-D parameters)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() <= 1]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def _vocab(model: nn.Module) -> int:
    inner = model.model if isinstance(model, WithScalar) else model
    return int(inner.config.vocab_size)


def engine_run(spec: RunSpec, check_quiescent: bool = True) -> dict[str, Any]:
    """Train on the engine in this rank; returns this rank's micro losses, the full final parameters, the ledger."""
    import hybridzero

    hybridzero.init_distributed()
    model = build_model(spec)
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    batches = batches_for(spec, world, _vocab(model))
    opt = client_optimizer(spec, model) if spec.optimizer == "client" else None
    engine, _, _, _ = hybridzero.initialize(
        model=model, config=ds_config(spec, world), optimizer=opt, record_events=True
    )
    engine.comm_ledger().reset()
    losses: list[list[float]] = []
    scales: list[tuple[float, bool]] = []
    for s in range(spec.steps):
        step_losses = []
        for m in range(spec.accumulation):
            ids = batches[s, m, rank]
            loss = engine(input_ids=ids, labels=ids).loss
            if (s, rank) in spec.inf_at:
                loss = loss * float("inf")
            engine.backward(loss)
            if check_quiescent:
                engine.assert_quiescent()
            engine.step()
            step_losses.append(loss.item())
        if check_quiescent:
            engine.assert_quiescent()
        losses.append(step_losses)
        scales.append((engine.loss_scale, engine.was_step_applied()))
        if s == 0 and spec.edit:
            targets = [engine.module.get_parameter(n) for n in spec.edit]
            with engine.gathered_parameters(targets, modifier_rank=0), torch.no_grad():
                for t in targets:
                    if rank == 0:
                        t.mul_(0.5).add_(0.01)
                    else:
                        t.zero_()  # discarded: rank 0's values are broadcast
            engine.assert_quiescent()
    ledger = engine.comm_ledger().snapshot()
    params = engine.full_parameters()
    state_numel = sum(int(t.numel()) for st in engine.optimizer.state.values() for k, t in st.items() if k == "exp_avg")
    return {
        "losses": losses,
        "params": params if rank == 0 else None,
        "ledger": ledger,
        "lr": engine.get_lr(),
        "exp_avg_numel": state_numel,
        "scales": scales,
        "invalidations": engine.prefetcher.invalidations,
        "prefetches": sum(1 for e in engine.events or [] if e[0] == "prefetch"),
        "group_numels": {g.name: (g.layout.padded_numel, g.replicated) for g in engine.groups},
    }


def step_losses(results: list[dict[str, Any]]) -> list[float]:
    """Mean over ranks and micro-steps of each step's losses, from per-rank ``engine_run`` results."""
    steps = len(results[0]["losses"])
    out = []
    for s in range(steps):
        vals = [v for r in results for v in r["losses"][s]]
        out.append(sum(vals) / len(vals))
    return out


def _rank_gradients(model: nn.Module, ids: torch.Tensor, gas: int) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    (loss / gas if gas > 1 else loss).backward()
    grads = {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    return loss.item(), grads


def _restore(model: nn.Module, opt: torch.optim.Optimizer, start: dict[str, Any]) -> None:
    """Continue from a consolidated checkpoint: parameters, per-element optimizer state and the step count."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(start["params"][name])
            if name in start["state"]:
                opt.state[p] = {k: v.clone() for k, v in start["state"][name].items()}
                opt.state[p]["step"] = torch.tensor(float(start["step"]))


def _reference_optimizer(opt_type: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """The plain optimizer the config block ``{"type": opt_type, "params": {"lr": lr, "weight_decay": 0.01}}``
    means (DeepSpeed's defaults: Lion's betas are (0.9, 0.999))."""
    from hybridzero.optim.lion import Lion

    classes: dict[str, Any] = {
        "AdamW": torch.optim.AdamW,
        "Adam": torch.optim.AdamW,
        "SGD": torch.optim.SGD,
        "Adagrad": torch.optim.Adagrad,
        "Lion": Lion,
    }
    return classes[opt_type](params, lr=lr, weight_decay=0.01)


def reference_run(spec: RunSpec, world_size: int, start: dict[str, Any] | None = None) -> dict[str, Any]:
    """The same training in this process, unsharded, fp32, plain torch optimizers.

    Gradients are combined exactly as the engine's order-deterministic reduction does: per micro-step the
    per-rank gradients of ``loss / accumulation`` are summed in rank order in fp32, divided by the world size, and
    accumulated over micro-steps; clipping uses the same fp64 norm. So fp32 runs agree bitwise where kernels allow.
    ``start`` ({"params", "state", "step"}) continues a run from consolidated checkpoint state.
    """
    from hybridzero.optim.clip import clip_coefficient
    from hybridzero.optim.schedulers import build_scheduler
    from hybridzero.optim.sharded import reference_grad_norm

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' setting: same kernels, same rounding
    try:
        model = build_model(spec)
        batches = batches_for(spec, world_size, _vocab(model))
        if spec.optimizer == "client":
            opt = client_optimizer(spec, model)
        else:
            opt = _reference_optimizer(spec.optimizer_type, model.parameters(), spec.lr)
        sched = None
        if spec.scheduler:
            block = ds_config(spec, world_size)["scheduler"]
            sched = build_scheduler(block["type"], block["params"], opt)
        first = 0
        if start is not None:
            _restore(model, opt, start)
            first = int(start["step"])
            with warnings.catch_warnings():  # fast-forwarding the schedule of a resumed run steps no optimizer
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
                for _ in range(first if sched is not None else 0):
                    sched.step()
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        losses = []
        for s in range(first, spec.steps):
            acc = {n: torch.zeros_like(p) for n, p in named.items()}
            step_loss = []
            for m in range(spec.accumulation):
                per_rank = [_rank_gradients(model, batches[s, m, r], spec.accumulation) for r in range(world_size)]
                step_loss += [loss for loss, _ in per_rank]
                for n in named:
                    total = per_rank[0][1][n].float().clone()
                    for r in range(1, world_size):
                        total.add_(per_rank[r][1][n])
                    acc[n].add_(total.div_(world_size))
            losses.append(sum(step_loss) / len(step_loss))
            for n, p in named.items():
                p.grad = acc[n]
            if any(step == s for step, _ in spec.inf_at):
                opt.zero_grad(set_to_none=True)  # the engine skips an overflowed step on every rank
                continue
            if spec.clipping > 0:
                coef = clip_coefficient(reference_grad_norm(acc.values()), spec.clipping)
                for g in acc.values():
                    g.mul_(coef)
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad(set_to_none=True)
            if s == 0:
                with torch.no_grad():
                    for n in spec.edit:
                        model.get_parameter(n).mul_(0.5).add_(0.01)
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        return {"losses": losses, "params": params, "lr": [g["lr"] for g in opt.param_groups]}
    finally:
        torch.set_num_threads(threads)
