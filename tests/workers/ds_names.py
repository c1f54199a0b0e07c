"""Per-rank bodies for the DeepSpeed-name tests: ``zero_to_fp32`` on our checkpoints, the gradient setters, and a
ZeRO-3 leaf module trained as one gather group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from tests.harness.parity import RunSpec
from tests.workers.ckpt import _engine, _train


def fp32_and_grad_setters(spec: RunSpec, ckpt: str) -> dict[str, Any]:
    """Train, save, consolidate with ``zero_to_fp32`` (against ``full_parameters``), then round-trip gradients
    through ``safe_set_full_grad`` / ``safe_set_local_grad`` and check the next step used them (``unmoved``: the
    zeroed parameter's first moment only decayed)."""
    from hybridzero.runtime.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
    )
    from hybridzero.utils import (
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_grad,
        safe_set_full_grad,
        safe_set_local_grad,
    )

    engine, batches, rank = _engine(spec)
    _train(engine, batches, rank, range(2), 1)
    engine.save_checkpoint(ckpt)
    full = engine.full_parameters()
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    fp32_equal = all(torch.equal(state[n], t) for n, t in full.items())
    script = Path(ckpt) / "zero_to_fp32.py"  # DeepSpeed's recovery-script workflow, on our checkpoint
    script_equal = False
    if rank == 0:
        convert_zero_checkpoint_to_fp32_state_dict(ckpt, str(Path(ckpt) / "fp32"), max_shard_size=4000)
        run = [sys.executable, str(script), ckpt, str(Path(ckpt) / "by_script"), "--safe_serialization"]
        subprocess.run(run, check=True, timeout=120)
        by_script = safetensors.torch.load_file(str(Path(ckpt) / "by_script" / "model.safetensors"))
        script_equal = set(by_script) == set(state) and all(torch.equal(by_script[n], state[n]) for n in state)
    torch.distributed.barrier()
    names = sorted(p.name for p in (Path(ckpt) / "fp32").iterdir())
    ids = batches[2, 0, rank]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    name, param = named[len(named) // 2]
    grad = safe_get_full_grad(param)
    assert grad is not None
    safe_set_full_grad(param, 2 * grad)
    full_roundtrip = torch.equal(safe_get_full_grad(param), 2 * grad)
    local = safe_get_local_grad(param)
    assert local is not None
    safe_set_local_grad(param, torch.zeros_like(local))
    zeroed = safe_get_full_grad(param)
    assert zeroed is not None
    # the step uses the zeroed gradient: Adam's first moment only decays, exp_avg' = beta1 * exp_avg
    before = safe_get_full_optimizer_state(param, "exp_avg")
    engine.step()
    after = safe_get_full_optimizer_state(param, "exp_avg")
    beta1 = engine.optimizer.param_groups[0]["betas"][0]
    engine.destroy()
    return {
        "fp32_equal": fp32_equal,
        "script_equal": script_equal,
        "script_executable": os.access(script, os.X_OK),
        "names": names,
        "full_roundtrip": full_roundtrip,
        "zeroed": bool((zeroed == 0).all()),
        "unmoved": bool(torch.allclose(after, beta1 * before, rtol=1e-6, atol=0)) and bool(before.abs().sum() > 0),
    }


def leaf_module_groups(spec: RunSpec, leaf_suffix: str) -> dict[str, Any]:
    """Mark the decoder-layer list's parent as a leaf through the config block; report the groups and the losses."""
    engine, batches, rank = _engine(spec.replace(extra_zero={"leaf_module": {"name_suffixes": [leaf_suffix]}}))
    owners = [g.owner for g in engine.groups]
    losses = _train(engine, batches, rank, range(spec.steps), 1)
    params = engine.full_parameters()
    engine.destroy()
    return {"owners": owners, "losses": losses, "params": params if rank == 0 else None}


def initialize_inside_init(inside: bool) -> dict[str, Any]:
    """Build a small model under ``zero.Init`` and call ``initialize`` inside the block (DeepSpeed accepts it) or
    after it; train two steps; return the losses and the full parameters."""
    import hybridzero

    hybridzero.init_distributed()
    rank = torch.distributed.get_rank()
    cfg = {"train_batch_size": 4, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2}}
    torch.manual_seed(0)
    with hybridzero.zero.Init(config_dict_or_path=cfg):
        model = torch.nn.Sequential(torch.nn.Linear(7, 11), torch.nn.ReLU(), torch.nn.Linear(11, 5))
        if inside:
            engine, *_ = hybridzero.initialize(model=model, config=cfg)
    if not inside:
        engine, *_ = hybridzero.initialize(model=model, config=cfg)
    x = torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(rank))
    losses = []
    for step in range(2):
        loss = engine(x[step]).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = engine.full_parameters()
    engine.destroy()
    return {"losses": losses, "params": params}


def ds_model_states(spec: RunSpec, ckpt: str) -> dict[str, Any]:
    """Train one step, save with and without frozen parameters, read DeepSpeed's ``mp_rank_00_model_states.pt``
    back with ``torch.load(weights_only=True)`` (rank 0), then resume from the save: the file does not make the
    directory look like DeepSpeed's, and the resumed engine holds the saved parameters."""
    engine, batches, rank = _engine(spec)
    _train(engine, batches, rank, range(1), 1)
    engine.save_checkpoint(str(Path(ckpt) / "all"))
    engine.save_checkpoint(str(Path(ckpt) / "trainable"), exclude_frozen_parameters=True)
    saved = engine.full_parameters()
    module = {n: t.detach().clone() for n, t in engine.module.state_dict().items()}
    frozen = sorted(n for n, p in engine.module.named_parameters() if not p.requires_grad)
    files: dict[str, Any] = {}
    for kind in ("all", "trainable"):
        path = Path(ckpt) / kind / "global_step1" / "mp_rank_00_model_states.pt"
        if rank == 0 and path.is_file():
            state = torch.load(path, weights_only=True)
            files[kind] = {
                "keys": list(state["module"]),
                "equal": all(torch.equal(t, module[n]) for n, t in state["module"].items()),
                "steps": state["global_steps"],
                "size": path.stat().st_size,
            }
    _train(engine, batches, rank, range(1, 2), 1)
    engine.load_checkpoint(str(Path(ckpt) / "all"))
    resumed = engine.full_parameters()
    engine.destroy()
    return {
        "files": files,
        "module_keys": list(module),
        "frozen": frozen,
        "resumed": all(torch.equal(resumed[n], t) for n, t in saved.items()),
    }
