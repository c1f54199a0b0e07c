"""``engine.optimizer`` answers DeepSpeed's ZeRO optimizer-wrapper names (``optimizer.optimizer``, ``fp16_groups``,
``fp32_partitioned_groups_flat``, ``get_fp32_grad_partitions()``, ``averaged_gradients``, ``_global_grad_norm``,
``loss_scale``, at stages 1-2 ``nccl_start_alignment_factor`` and ``parallel_partitioned_bit16_groups``) with live
values: the ranks' gradient parts of each parameter, in rank order, are the averaged
gradient of the single-process reference (then, for a gather group's last parameter, the shard's zero padding, as
DeepSpeed's padded partitions); the parts and the master leaves are the shards themselves."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.test_deepspeed_api import reference_grads
from tests.harness.parity import RunSpec, build_model
from tests.workers.zero_optimizer import facade_run

pytestmark = pytest.mark.timeout(600)


def _spec(stage: int, **kw: Any) -> RunSpec:
    base = RunSpec(
        model="llama",
        steps=2,
        stage=stage,
        accumulation=2,
        persistence_threshold=50,
        clipping=1.0,
        frozen=("layers.0.self_attn.q_proj",),
    )
    return base.replace(**kw)


def _check(got: list[dict[str, Any]], spec: RunSpec) -> None:
    world = len(got)
    want = reference_grads(spec, world, 0)
    frozen = {n for n, p in build_model(spec).named_parameters() if not p.requires_grad}
    for r in got:
        flags = ("agree", "grads_were_live", "identity", "leaves_stepped_in_place", "lr_shared", "overflow")
        flags += ("missing_named", "partitions", "fetch_hooks")
        assert all(r[f] for f in flags), {f: r[f] for f in flags}
        assert r["step_counts"] and all(s == r["global_steps"] == 2 for s in r["step_counts"]), r["step_counts"]
        norm, engine_norm = r["norm"]
        assert norm is not None and norm == engine_norm and norm > 0
        assert not frozen & set(r["parts"]), "a frozen parameter has no fp32 gradient partition"
    scales = {r["scale"] for r in got}
    assert len(scales) == 1 and len(set(next(iter(scales)))) == 1
    assert next(iter(scales))[0] == (1.0 if spec.dtype != "fp16" else next(iter(scales))[0])
    for name, full in want.items():
        if name in frozen:
            continue
        parts = [r["parts"].get(name, torch.zeros(0)) for r in got]
        whole = full.reshape(-1)
        cat = torch.cat(parts)
        if len(parts) > 1 and all(p.numel() == whole.numel() for p in parts):  # persistent: each part is whole
            cat = parts[0]
            for p in parts[1:]:
                assert torch.equal(p, parts[0]), name
        assert cat.numel() >= whole.numel() and not cat[whole.numel() :].any(), (name, "padding is zero")
        torch.testing.assert_close(cat[: whole.numel()], whole, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_facade_world2(world, stage: int) -> None:
    spec = _spec(stage)
    _check(world(2).run(facade_run, spec), spec)


def test_facade_world1_and_3(world) -> None:
    spec = _spec(3)
    _check(world(1).run(facade_run, spec), spec)
    _check(world(3).run(facade_run, spec), spec)


def test_facade_fp16_loss_scale(world) -> None:
    """Under fp16 the parts hold the loss-scaled gradient until step() unscales it (as DeepSpeed's do)."""
    spec = _spec(3, dtype="fp16", fp16={"initial_scale_power": 4})
    got = world(2).run(facade_run, spec)
    for r in got:
        assert r["scale"][0] == r["scale"][1] == r["scale"][2] > 1
