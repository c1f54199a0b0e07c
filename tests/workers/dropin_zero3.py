"""Per-rank bodies of tests/distributed/test_deepspeed_api.py for DeepSpeed's ZeRO-3 parameter surface: the ``ds_*``
attributes of an engine's parameters and ``unwrap_model_for_generation``."""

from __future__ import annotations

from typing import Any

import torch

from hybridzero import utils
from tests.harness.parity import RunSpec, build_model
from tests.workers.dropin import _setup


def ds_attributes(spec: RunSpec) -> dict[str, Any]:
    """DeepSpeed's read-only ``ds_*`` attributes on every parameter of a ZeRO-3 engine (none at stages 0-2): the full
    shape and size, a unique id, ``ds_persist`` for the persistent ones, and ``ds_tensor`` (this rank's part, compute
    dtype) sized as ``safe_get_local_fp32_param`` and equal to it; a deep copy (unowned) and a destroyed engine's
    parameters have none."""
    import copy

    engine, _, _, world = _setup(spec)
    named = dict(engine.module.named_parameters())
    eager = dict(build_model(spec).named_parameters())
    if spec.stage != 3:
        return {"none": not any(hasattr(p, "ds_id") for p in named.values())}
    local_ok, parts = True, {}
    for n, p in named.items():
        local = utils.safe_get_local_fp32_param(p)
        part = p.ds_tensor
        local_ok &= part.dtype == torch.float32 and (local is None or torch.equal(part, local))
        parts[n] = part
    import hybridzero as deepspeed
    from hybridzero.runtime.zero.partition_parameters import ZeroParamStatus as Status

    rest = [p.ds_status for p in named.values()]
    with deepspeed.zero.GatheredParameters(list(named.values())):
        inside = {p.ds_status for p in named.values()}
    out = {
        "status": Status.NOT_AVAILABLE in rest
        and set(rest) <= {Status.AVAILABLE, Status.NOT_AVAILABLE}
        and inside == {Status.AVAILABLE}
        and [p.ds_status for p in named.values()] == rest,
        "shape": all(p.ds_shape == eager[n].shape and p.ds_numel == eager[n].numel() for n, p in named.items()),
        "ids": sorted(p.ds_id for p in named.values()) == list(range(len(named))),
        # ds_persist: exactly the parameters under the persistence threshold, whole (AVAILABLE) at rest
        "persist": {n: p.ds_persist for n, p in named.items()}
        == {n: eager[n].numel() <= spec.persistence_threshold for n in named}
        and any(p.ds_persist for p in named.values())
        and all(p.ds_status is Status.AVAILABLE and p.numel() > 0 for p in named.values() if p.ds_persist),
        "local": local_ok,
        "parts": parts,
        "copy_unowned": not hasattr(copy.deepcopy(next(iter(named.values()))), "ds_id"),
        # ds_summary(): DeepSpeed's description, read from the same answers (its tests put it in assertion messages)
        "summary": all(
            p.ds_summary()
            == {
                "id": p.ds_id,
                "status": p.ds_status.name,
                "numel": p.numel(),
                "ds_numel": eager[n].numel(),
                "shape": tuple(p.shape),
                "ds_shape": tuple(eager[n].shape),
                "requires_grad": p.requires_grad,
                "grad_shape": None,
                "persist": p.ds_persist,
                "ds_tensor.shape": (parts[n].numel(),),
            }
            for n, p in named.items()
        ),
    }
    name, probe = next(iter(named.items()))
    probe.ds_tensor.fill_(123.0)  # a copy: the write is lost (README, "Differences, on purpose")
    out["write_lost"] = torch.equal(probe.ds_tensor, parts[name])
    engine.destroy()
    out["destroyed"] = all(type(p) is torch.nn.Parameter and not hasattr(p, "ds_id") for p in named.values())
    out["world"] = world
    return out


def unwrap_for_generation(spec: RunSpec, use_unwrap: bool) -> dict[str, Any]:
    """DeepSpeed's ``runtime.zero.unwrap_model_for_generation(engine)`` between training steps: inside, every
    parameter is whole (its full shape, equal to ``safe_get_full_fp32_param``), the module keeps its train/eval mode,
    and a greedy ``engine.module.generate`` issues no collective at all; after it the parameters are partitioned
    again. Training around it gives the losses of the same run without it (``use_unwrap=False``)."""
    from hybridzero.runtime.zero import unwrap_model_for_generation

    engine, batches, rank, _ = _setup(spec)
    named = dict(engine.module.named_parameters())
    losses, checks, tokens = [], [], []
    for s in range(spec.steps):
        ids = batches[s, 0, rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
        if not use_unwrap:
            continue
        full = {n: utils.safe_get_full_fp32_param(p) for n, p in named.items()}
        prompt = ids[:1, :4]
        first = next(m for m in engine.module.modules() if m is not engine.module)
        first.eval()  # a submodule the user put in eval mode keeps it through the block (and the nested generate)
        modes = [m.training for m in engine.module.modules()]
        fetch = engine.optimizer.parameter_offload  # DeepSpeed's owner of the fetch hooks (its test_unwrap_model)
        hooks_before = len(fetch.forward_hooks)
        with unwrap_model_for_generation(engine) as unwrapped, torch.no_grad():
            hooks_inside = len(fetch.forward_hooks)
            mark = engine.comm_ledger().copy()
            whole = all(  # a frozen parameter's fp32 read is None (as in DeepSpeed): its full shape is checked
                p.shape == p.ds_shape and (full[n] is None or torch.equal(p.float(), full[n])) for n, p in named.items()
            )
            out = unwrapped.module.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
            again = unwrapped.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)  # nested: re-entrant
            quiet = engine.comm_ledger().since(mark).total().calls == 0
            kept = [m.training for m in engine.module.modules()] == modes
            checks.append(whole and quiet and kept and unwrapped is engine and torch.equal(out, again))
        checks.append([m.training for m in engine.module.modules()] == modes)
        # two per hooked module (root, blocks, root-parameter holders) outside the block, none in effect inside
        hooked = 1 + engine.module.config.num_hidden_layers  # at least the root and every block
        checks.append(hooks_inside == 0 and hooks_before == len(fetch.forward_hooks) >= 2 * hooked)
        first.train()
        tokens.append(out[0, 4:].tolist())
        checks.append(any(p.numel() == 0 for p in named.values()))  # partitioned again
    try:
        unwrap_model_for_generation(engine.module).__enter__()
        checks.append(False)
    except TypeError as exc:
        checks.append("pass the engine" in str(exc))
    return {"losses": torch.stack(losses), "checks": checks, "tokens": tokens}
