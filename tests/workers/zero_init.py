"""Per-rank bodies for ``zero.Init`` tests: construction under Init equals eager construction bit for bit, writes
made by constructors survive, the hooks do not outlive the block (the memory measurement, that no rank ever holds
the whole model: :mod:`tests.workers.zero_init_memory`)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from tests.harness.models import MODEL_FACTORIES
from tests.harness.parity import RunSpec, batches_for, ds_config


def _gathered(params: list[nn.Parameter], modifier_rank: int | None) -> contextlib.AbstractContextManager[None]:
    """The engine-free ``GatheredParameters`` path: the registered owner of the parameters, or nothing to do."""
    from hybridzero.zero.registry import REGISTRY

    owner = REGISTRY.owner_of(params[0])
    return owner.gathered(params, modifier_rank) if owner is not None else contextlib.nullcontext()


def _train(model: nn.Module, spec: RunSpec) -> tuple[dict[str, torch.Tensor], list[float], Any]:
    import hybridzero

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    batches = batches_for(spec, world, int(model.config.vocab_size))
    engine, *_ = hybridzero.initialize(model=model, config=ds_config(spec, world))
    start = engine.full_parameters()
    losses = []
    for s in range(spec.steps):
        ids = batches[s, 0, rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.assert_quiescent()
    return start, losses, engine


def hf_model_matches_eager(model: str, stage: int) -> dict[str, Any]:
    """Build ``model`` eagerly and under ``zero.Init`` (same seed), initialize both, compare start parameters and
    the losses of 3 training steps exactly."""
    import hybridzero
    from hybridzero.zero.registry import REGISTRY

    hybridzero.init_distributed()
    spec = RunSpec(model=model, stage=stage)
    eager_start, eager_losses, _ = _train(MODEL_FACTORIES[model](seed=0), spec)
    with hybridzero.zero.Init(config_dict_or_path=ds_config(spec, torch.distributed.get_world_size())) as init:
        built = MODEL_FACTORIES[model](seed=0)
    assert init.store is not None
    placeholders = all(p.numel() == 0 and p.ds_numel > 0 for p in built.parameters())
    held = init.store.held_bytes()
    init_start, init_losses, engine = _train(built, spec)
    return {
        "names": sorted(init_start) == sorted(eager_start),
        "mismatched": [n for n in eager_start if not torch.equal(eager_start[n], init_start[n])],
        "losses": (eager_losses, init_losses),
        "placeholders": placeholders,
        "held_fraction": held / sum(t.numel() * 4 for t in eager_start.values()),
        "store_released": init.store.held_bytes() == 0,
        "owner_is_not_init": all(REGISTRY.owner_of(p) is not init.store for p in engine.module.parameters()),
    }


def differently_seeded_ranks_agree_on_rank_0() -> list[str]:
    """Each rank seeds differently (``seed=rank``); the Init-built model is rank 0's eager model on every rank, as
    an eager-built model handed to ``initialize`` is (every partition and re-partition broadcasts from rank 0)."""
    import hybridzero

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    want = {n: p.detach().clone() for n, p in MODEL_FACTORIES["llama"](seed=0).named_parameters()}
    with hybridzero.zero.Init():
        model = MODEL_FACTORIES["llama"](seed=rank)
    engine, *_ = hybridzero.initialize(model=model, config=ds_config(RunSpec(), world))
    got = engine.full_parameters()
    return [n for n in want if not torch.equal(want[n], got[n])]


def module_argument_partitions_a_built_model() -> dict[str, Any]:
    """``zero.Init(module=model)`` partitions an eagerly built model at once; ``initialize`` then equals eager."""
    import hybridzero

    hybridzero.init_distributed()
    model = MODEL_FACTORIES["gpt2_tied"](seed=0)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    init = hybridzero.zero.Init(module=model)
    assert init.store is not None
    placeholders = all(p.numel() == 0 and p.ds_numel > 0 for p in model.parameters())
    engine, *_ = hybridzero.initialize(
        model=model, config=ds_config(RunSpec(model="gpt2_tied"), torch.distributed.get_world_size())
    )
    got = engine.full_parameters()
    return {
        "placeholders": placeholders,
        "mismatched": [n for n in want if not torch.equal(want[n], got[n])],
        "names": sorted(got) == sorted(want),
    }


def custom_init_(module: nn.Module) -> None:
    """A user's init function: xavier for every Linear weight, then halved through ``.data``."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            m.weight.data.mul_(0.5)


class Block(nn.Module):
    """A child built (optionally) inside a nested ``zero.Init``."""

    def __init__(self, nested: bool) -> None:
        super().__init__()
        import hybridzero

        with hybridzero.zero.Init(enabled=nested):
            self.up = nn.Linear(7, 13)
            self.down = nn.Linear(13, 7, bias=False)
        with torch.no_grad():
            self.down.weight.data.copy_(self.up.weight.data.t() * 2)  # reads one partitioned parameter into another


class Custom(nn.Module):
    """Every kind of constructor write: fill_, a custom init function, a modifier-rank edit, tied weights, a
    parameter of the top-level module, nested contexts."""

    def __init__(self, rank: int, nested: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(7, 5)
        with torch.no_grad():
            self.lin.bias.fill_(0.25)
        self.emb = nn.Embedding(11, 7, padding_idx=3)
        self.head = nn.Linear(7, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.scale = nn.Parameter(torch.full((5,), 3.0))
        self.blocks = nn.ModuleList(Block(nested) for _ in range(2))
        custom_init_(self)
        with _gathered([self.lin.weight], modifier_rank=0), torch.no_grad():
            if rank == 0:
                self.lin.weight[0].fill_(7.0)
            else:
                self.lin.weight.zero_()  # discarded: rank 0's value is broadcast
        with torch.no_grad():
            self.scale.mul_(self.lin.bias.sum())


def _full(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full values of every parameter (deduplicated names) through the store's gathered()."""
    out = {}
    for name, p in module.named_parameters():
        with _gathered([p], None):
            out[name] = p.detach().clone()
    return out


def custom_module_matches_eager(nested: bool) -> dict[str, Any]:
    """The custom module under ``zero.Init`` (every rank) equals the eager module built as rank 0, before and after
    ``initialize``; ties survive."""
    import hybridzero

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(5)
    # the reference is built without any Init (a Block's own Init would partition it: not eager any more)
    eager = {n: p.detach().clone() for n, p in Custom(0, nested=False).named_parameters()}
    torch.manual_seed(5)
    with hybridzero.zero.Init():
        built = Custom(rank, nested)
    before = _full(built)
    engine, *_ = hybridzero.initialize(model=built, config=ds_config(RunSpec(), world))
    after = engine.full_parameters()
    return {
        "before": [n for n in eager if not torch.equal(eager[n], before[n])],
        "after": [n for n in eager if not torch.equal(eager[n], after[n])],
        "names": sorted(after) == sorted(eager),
        "tied": engine.module.head.weight is engine.module.emb.weight,
        "padding_row": float(after["emb.weight"][3].abs().sum()),
    }


def enabled_false_and_exceptions() -> dict[str, Any]:
    """``enabled=False`` builds eagerly; an exception inside the block removes the hooks and the mode."""
    import hybridzero
    from hybridzero.zero.registry import REGISTRY

    hybridzero.init_distributed()
    hooks = (
        len(nn.modules.module._global_module_registration_hooks),
        len(nn.modules.module._global_parameter_registration_hooks),
    )
    torch.manual_seed(1)
    want = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7)).state_dict()
    torch.manual_seed(1)
    with hybridzero.zero.Init(enabled=False):
        plain = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7))
    eager_ok = all(torch.equal(want[k], v) for k, v in plain.state_dict().items())
    unowned = all(REGISTRY.owner_of(p) is None for p in plain.parameters())
    raised = False
    try:
        with hybridzero.zero.Init():
            nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7))
            raise KeyError("inside")
    except KeyError:
        raised = True
    after_hooks = (
        len(nn.modules.module._global_module_registration_hooks),
        len(nn.modules.module._global_parameter_registration_hooks),
    )
    later = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7))  # built outside: whole, owned by nobody
    whole = all(p.stride() != (0,) * p.dim() and REGISTRY.owner_of(p) is None for p in later.parameters())
    bad = []
    for kwargs in ({"remote_device": "nvme"}, {"mpu": object()}, {"dtype": torch.int8}):
        try:
            hybridzero.zero.Init(**kwargs)
        except ValueError as exc:
            bad.append(str(exc))
    inside = ""
    with hybridzero.zero.Init():
        small = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7))
        try:  # DeepSpeed accepts initialize inside the block: the context is paused for it
            engine, *_ = hybridzero.initialize(
                model=small, config=ds_config(RunSpec(), torch.distributed.get_world_size())
            )
            inside = "ok" if engine.zero_optimization_stage() == 3 else "wrong stage"
            engine.destroy()
        except RuntimeError as exc:
            inside = str(exc)
    return {
        "eager_ok": eager_ok,
        "unowned": unowned,
        "raised": raised,
        "hooks": (hooks, after_hooks),
        "whole_after": whole,
        "errors": bad,
        "initialize_inside": inside,
    }


def gathered_block_frees(hidden: int = 10) -> dict[str, Any]:
    """DeepSpeed's ``TestZeroGatheredParametersFree`` in hybridzero's terms: a ``Linear`` built under ``zero.Init``
    (no engine yet) is whole inside ``GatheredParameters`` and freed after it: size 0 again, as in DeepSpeed, with
    the whole shape in ``ds_shape`` and nothing whole in the store; the same once an engine owns it."""
    import hybridzero
    from hybridzero.zero.registry import full_shape

    hybridzero.init_distributed()
    world = torch.distributed.get_world_size()
    ds_cfg = {"train_batch_size": world, "zero_optimization": {"stage": 3}}
    with hybridzero.zero.Init(config_dict_or_path=ds_cfg) as init:
        model = nn.Sequential(nn.Linear(hidden, hidden))
    assert init.store is not None
    weight = model[0].weight
    with hybridzero.zero.GatheredParameters(list(model.parameters())):
        inside = weight.numel() == hidden * hidden and weight.stride() == (hidden, 1)
    after_init = (
        weight.shape == (0,)
        and weight.ds_shape == full_shape(weight) == (hidden, hidden)
        and weight.untyped_storage().nbytes() == 0
        and init.store.open_params() == []
    )
    cfg = {"train_batch_size": world, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = hybridzero.initialize(model=model, config=cfg)
    with hybridzero.zero.GatheredParameters(list(model.parameters())):
        inside_engine = weight.numel() == hidden * hidden
    engine.assert_quiescent()
    after_engine = weight.numel() if full_shape(weight) == (hidden, hidden) else -1
    return {"inside": inside, "after_init": after_init, "inside_engine": inside_engine, "after_engine": after_engine}


def init_ds_attributes(stage: int) -> dict[str, Any]:
    """DeepSpeed's ``ds_*`` attributes on parameters built under ``zero.Init`` (its ``TestGatherUpdate`` /
    ``TestScatterGather``, here on a ``Linear(5, 3)`` whose 15 and 3 elements divide by no world size > 1): at rest
    ``NOT_AVAILABLE`` with the full shape, ``AVAILABLE`` inside ``GatheredParameters``; ``ds_tensor`` is this rank's
    padded slice; a modifier rank's edit is global; a parameter built outside has none. Then an engine takes the
    parameters over: at ZeRO-3 it answers (ids renumbered by the engine), at stage 2 there are no attributes (as in
    DeepSpeed); after ``destroy`` the class is plain again."""
    import hybridzero

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = {"train_batch_size": world, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    with hybridzero.zero.Init(config_dict_or_path=cfg):
        lin = nn.Linear(5, 3)
    outside = nn.Linear(5, 3)
    w, b = lin.weight, lin.bias
    out: dict[str, Any] = {
        "rest": (w.ds_status, b.ds_status),
        "shape": (tuple(w.ds_shape), w.ds_numel, tuple(b.ds_shape)),
        "ids": sorted({w.ds_id, b.ds_id}) == [0, 1],
        "persist": (w.ds_persist, b.ds_persist),
        "outside": hasattr(outside.weight, "ds_status") or hasattr(outside.weight, "ds_id"),
        "part": w.ds_tensor,
    }
    with hybridzero.zero.GatheredParameters(w, modifier_rank=world - 1):
        out["inside"] = w.ds_status
        out["whole"] = w.detach().clone()
        if rank == world - 1:
            with torch.no_grad():
                w.zero_()
    out["after"] = w.ds_status
    with hybridzero.zero.GatheredParameters(w):
        out["zeroed"] = bool(torch.equal(w, torch.zeros_like(w)))
    engine, *_ = hybridzero.initialize(model=lin, config=cfg)
    if stage == 3:
        out["engine"] = (w.ds_status, tuple(w.ds_shape), sorted({w.ds_id, b.ds_id}) == [0, 1])
    else:
        out["engine"] = hasattr(w, "ds_id") or hasattr(w, "ds_status")
    engine.destroy()
    out["destroyed"] = type(w) is nn.Parameter and not hasattr(w, "ds_id")
    return out


def parameter_of_a_partitioned_one() -> dict[str, Any]:
    """``nn.Parameter(p)`` of a ``zero.Init`` parameter inside ``GatheredParameters`` (torch's parametrizations do it:
    ``weight_norm``): a new parameter no one owns yet, of the whole value; once registered on a module of the block it
    is partitioned like any other (``ds_shape`` its shape) and reads back whole inside ``GatheredParameters``. The
    engine then trains the parametrized module."""
    import hybridzero
    from hybridzero.zero import GatheredParameters, Init

    hybridzero.init_distributed()
    torch.manual_seed(0)
    want = nn.Linear(5, 7).weight.detach().clone()
    torch.manual_seed(0)
    cfg = {"train_batch_size": 2 * torch.distributed.get_world_size(), "zero_optimization": {"stage": 3}}
    with Init(config_dict_or_path=cfg):
        lin = nn.Linear(5, 7)
        with GatheredParameters(lin.weight, modifier_rank=0):
            p = nn.Parameter(lin.weight)
            fresh = isinstance(p, nn.Parameter) and p is not lin.weight and not hasattr(p, "ds_id")
            whole = torch.equal(p.detach(), want)
        holder = nn.Module()
        holder.w = p
        conv = nn.Conv1d(3, 5, 3)
        with GatheredParameters(conv.weight, modifier_rank=0):
            conv = nn.utils.parametrizations.weight_norm(conv, name="weight", dim=2)
    owned = hasattr(p, "ds_id") and p.ds_shape == want.shape
    with GatheredParameters([p]):
        back = torch.equal(p.detach(), want)
    engine, *_ = hybridzero.initialize(model=conv, config={**cfg, "optimizer": {"type": "Adam", "params": {}}})
    x = torch.randn(2, 3, 9, generator=torch.Generator().manual_seed(1))
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
    return {"fresh": fresh, "whole": whole, "owned": owned, "back": back, "loss": loss.item()}
