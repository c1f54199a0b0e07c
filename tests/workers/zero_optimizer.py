"""Per-rank body: DeepSpeed's ZeRO optimizer-wrapper names on ``engine.optimizer`` (runtime/zero_optimizer.py),
read the way DeepSpeed's own unit tests read them, over one accumulated step and one more."""

from __future__ import annotations

from typing import Any

import torch

from tests.workers.dropin import _setup


def _names_of(engine: Any) -> dict[int, str]:
    return {id(p): n for n, p in engine.module.named_parameters()}


def _read_parts(engine: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], bool]:
    """Each parameter's part of the fp32 gradient (a live view and a copy, by name) from
    ``get_fp32_grad_partitions()``, and whether ``averaged_gradients`` / ``fp16_groups`` agree with it: one entry
    per optimizer param group (DeepSpeed's sub-groups), ``fp32_partitioned_groups_flat`` one per master leaf."""
    opt = engine.optimizer
    names = _names_of(engine)
    parts, avg, groups = opt.get_fp32_grad_partitions(), opt.averaged_gradients, opt.fp16_groups
    stage12 = engine.zero_optimization_stage() in (1, 2)
    leaves = [leaf for pg in opt.optimizer.param_groups for leaf in pg["params"]]
    agree = (
        sorted(parts) == list(range(len(groups))) == sorted(avg)
        and len(groups) == len(opt.optimizer.param_groups)
        and [id(t) for t in opt.fp32_partitioned_groups_flat] == [id(t) for t in leaves]
        and (not stage12 or (opt.bit16_groups == groups and opt.single_partition_of_fp32_groups is not None))
    )
    live, copies = {}, {}
    for j, params in enumerate(groups):
        agree &= sorted(parts[j]) == list(range(len(params))) and len(avg[j]) == len(params)
        for i, p in enumerate(params):
            agree &= parts[j][i].dtype == torch.float32 and torch.equal(parts[j][i], avg[j][i])
            live[names[id(p)]] = parts[j][i]
            copies[names[id(p)]] = parts[j][i].clone()
    return live, copies, agree


def _partitions_ok(engine: Any) -> bool:
    """Stages 1-2: ``nccl_start_alignment_factor`` is the layout's partition alignment (2 elements), and each entry of
    ``parallel_partitioned_bit16_groups`` is one gather group's flat buffer in equal rank parts, contiguous, each
    starting 4-byte aligned in 16-bit (DeepSpeed's ``TestPartitionNcclAlignment`` check) and viewing the very
    storage the module's parameters compute with (values equal at each parameter's offset). Stage 3: both refuse."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() == 3:
        try:
            opt.parallel_partitioned_bit16_groups  # noqa: B018 - no whole 16-bit buffer at rest at stage 3
        except AttributeError as exc:
            return "stages 1-2" in str(exc)
        return False
    factor, groups = opt.nccl_start_alignment_factor, opt.parallel_partitioned_bit16_groups
    ok = factor == 2 and len(groups) > 0
    bases = {}
    for parts in groups:
        size, item = parts[0].numel(), parts[0].element_size()
        ok &= size % factor == 0 and all(t.numel() == size for t in parts)
        ok &= all(t.data_ptr() == parts[0].data_ptr() + r * size * item for r, t in enumerate(parts))
        ok &= all(t.data_ptr() % (2 * factor) == 0 for t in parts)
        bases[parts[0].untyped_storage().data_ptr()] = (parts[0].storage_offset(), torch.cat(parts))
    for p in engine.module.parameters():
        start, flat = bases.get(p.untyped_storage().data_ptr(), (None, None))
        if start is None or flat is None:
            return False
        at = p.storage_offset() - start
        ok &= torch.equal(flat[at : at + p.numel()].view(p.shape), p.detach())
    return bool(ok)


def facade_run(spec: Any) -> dict[str, Any]:
    """Step 0 (``spec.accumulation`` micro-steps): the gradient parts at the boundary, before ``step``; then the
    facade's identity with the torch optimizer, the liveness of the parts and the leaves across ``step``, and the
    Adam step count of every sub-group (DeepSpeed's ``TestZeroAdamOptimizerStepCount``)."""
    engine, batches, rank, world = _setup(spec)
    opt = engine.optimizer
    out: dict[str, Any] = {"world": world}
    for m in range(spec.accumulation):
        ids = batches[0, m, rank]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.allreduce_gradients()  # DeepSpeed's tests call it before reading averaged_gradients: a no-op here
        if engine.is_gradient_accumulation_boundary():
            live, out["parts"], out["agree"] = _read_parts(engine)
        engine.step()
    # the parts read before the step were views of the gradient shards: step() zeroed them in place
    out["grads_were_live"] = all(not t.any() for t in live.values()) and any(t.numel() for t in live.values())
    leaves = opt.fp32_partitioned_groups_flat
    before = [leaf.detach().clone() for leaf in leaves]
    for m in range(spec.accumulation):
        ids = batches[1, m, rank]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    inner = opt.optimizer
    steps = [inner.state[leaf]["step"] for leaf in leaves]
    out["identity"] = (
        isinstance(opt, torch.optim.Optimizer)
        and type(inner) is torch.optim.AdamW
        and opt.param_groups is inner.param_groups
        and opt.state is inner.state
        and opt.state_dict()["param_groups"] == inner.state_dict()["param_groups"]
    )
    # the step moved the master through the leaves read before it (a leaf holding only never-used embedding rows
    # may stay put: zero gradient, zero moments)
    out["leaves_stepped_in_place"] = len(leaves) > 0 and any(
        not torch.equal(leaf.detach(), b) for leaf, b in zip(leaves, before)
    )
    out["partitions"] = _partitions_ok(engine)
    out["step_counts"] = [float(s) for s in steps]
    out["global_steps"] = engine.global_steps
    out["norm"] = (opt._global_grad_norm, engine.get_global_grad_norm())
    out["scale"] = (opt.loss_scale, opt.cur_scale, engine.loss_scale)
    out["overflow"] = opt.overflow is engine.overflow is False
    try:
        opt.fp32_groups_gradients_flat  # noqa: B018 - BF16_Optimizer's whole flat gradient: not provided, and the
        out["missing_named"] = False  # error says whose optimizer was asked
    except AttributeError as exc:
        out["missing_named"] = "ZeroOptimizer over AdamW" in str(exc) and "fp32_groups_gradients_flat" in str(exc)
    try:  # DeepSpeed's owner of the ZeRO-3 fetch hooks: its forward hooks at stage 3, refused naming the stage else
        out["fetch_hooks"] = len(opt.parameter_offload.forward_hooks) > 0 and spec.stage == 3
    except AttributeError as exc:
        out["fetch_hooks"] = spec.stage != 3 and f"runs stage {spec.stage}" in str(exc)
    opt.param_groups[0]["lr"] = 0.125  # a write through the facade is the torch optimizer's
    out["lr_shared"] = inner.param_groups[0]["lr"] == 0.125 and engine.get_lr()[0] == 0.125
    engine.destroy()
    return out
