"""DeepSpeed's engine-free API on hybridzero: ``zero.GatheredParameters`` without an engine, the ``utils``
tensor-fragment functions, ``comm``, ``initialize(args=...)`` and the engine as an ``nn.Module``, each checked
against a single-process reference or the plain model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.test_zero3_parity import compare
from tests.harness.parity import RunSpec, batches_for, build_model, engine_run, reference_run
from tests.workers.dropin import (
    client_scheduler_object,
    comm_face,
    edit_without_modifier,
    fragments_run,
    initialize_with_args,
    module_surface,
    set_state_roundtrip,
    unowned_and_two_engines,
)
from tests.workers.dropin_zero3 import ds_attributes, unwrap_for_generation
from tests.workers.partition_cache import evicting_run

pytestmark = pytest.mark.timeout(600)

EDITS = ("model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight", "model.norm.weight")


def _spec(stage: int, accumulation: int = 1) -> RunSpec:
    # embed_tokens frozen (a frozen parameter in the root group); small norms persistent at stage 3
    return RunSpec(
        model="llama",
        steps=3,
        stage=stage,
        accumulation=accumulation,
        edit=EDITS,
        persistence_threshold=50,
        frozen=("layers.0.self_attn.q_proj",),
    )


def reference_grads(spec: RunSpec, world_size: int, step: int) -> dict[str, torch.Tensor]:
    """The averaged gradient the engine reduces at ``step``: parameters after ``step`` reference steps (with the
    spec's edit after step 0), then each rank's micro-batch gradient of ``loss / accumulation``, summed in rank
    order, divided by the world size, accumulated over micro-steps."""
    params = reference_run(spec.replace(steps=step), world_size)["params"] if step else None
    model = build_model(spec)
    if params is not None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n])
    batches = batches_for(spec, world_size, int(model.config.vocab_size))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        acc = {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
        for m in range(spec.accumulation):
            total: dict[str, torch.Tensor] = {}
            for r in range(world_size):
                model.zero_grad(set_to_none=True)
                loss = model(input_ids=batches[step, m, r], labels=batches[step, m, r]).loss
                (loss / spec.accumulation if spec.accumulation > 1 else loss).backward()
                for n in acc:
                    g = model.get_parameter(n).grad
                    total[n] = g.clone() if r == 0 else total[n].add_(g)
            for n, value in acc.items():
                value.add_(total[n].div_(world_size))
        return acc
    finally:
        torch.set_num_threads(threads)


def _check_fragments(results: list[dict[str, Any]], spec: RunSpec, world_size: int) -> None:
    frozen = {n for n, p in build_model(spec).named_parameters() if not p.requires_grad}
    for step in (0, 1):
        want = reference_grads(spec, world_size, step)
        for res in results:
            for name, got in res["grads"][step].items():
                if name in frozen:
                    assert got is None, name
                    continue
                torch.testing.assert_close(
                    got, want[name], rtol=1e-6, atol=1e-7, msg=lambda m, n=name, s=step: f"step {s} {n}: {m}"
                )
    for name in results[0]["final"]:
        full = results[0]["final"][name]
        for key, parts in (
            ("local_params", [r["local_params"][name] for r in results]),
            ("local_grads", [r["local_grads"][-1][name] for r in results]),
        ):
            if name in frozen:  # no fp32 state for a frozen parameter (DeepSpeed's None)
                assert all(p is None for p in parts)
                continue
            whole = (full if key == "local_params" else results[0]["grads"][-1][name]).reshape(-1)
            cat = torch.cat(parts)
            # sharded: the ranks' parts in rank order are the parameter; whole on every rank: each part is
            assert torch.equal(cat, whole) or all(torch.equal(p, whole) for p in parts), (name, key)
        exp_full, _ = results[0]["exp_avg"][name]
        if name in frozen:
            assert exp_full is None
            continue
        g0 = results[0]["grads"][0][name]
        torch.testing.assert_close(exp_full, 0.1 * g0, rtol=1e-5, atol=1e-8)  # AdamW's first moment after step 1
        locals_ = torch.cat([r["exp_avg"][name][1] for r in results])
        assert torch.equal(locals_, exp_full.reshape(-1)) or torch.equal(
            results[0]["exp_avg"][name][1], exp_full.reshape(-1)
        )


@pytest.mark.parametrize("edit_via", ["gathered", "safe_set"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fragments_and_engine_free_edit_match_reference(world, stage: int, edit_via: str) -> None:
    """World 2, every stage: full gradients (trainable and frozen), local parts, optimizer state, and an edit
    through ``zero.GatheredParameters(modifier_rank=0)`` or ``safe_set_full_fp32_param`` train exactly like the
    same edit on the reference."""
    spec = _spec(stage)
    results = world(2).run(fragments_run, spec, edit_via)
    compare(results, reference_run(spec, 2))
    _check_fragments(results, spec, 2)


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_fragments_other_world_sizes(world, world_size: int) -> None:
    spec = _spec(3, accumulation=2)
    results = world(world_size).run(fragments_run, spec, "safe_set")
    compare(results, reference_run(spec, world_size))
    _check_fragments(results, spec, world_size)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fragments_every_stage_and_world(world, world_size: int, stage: int) -> None:
    spec = _spec(stage, accumulation=2)
    results = world(world_size).run(fragments_run, spec, "gathered")
    compare(results, reference_run(spec, world_size))
    _check_fragments(results, spec, world_size)


@pytest.mark.slow
@pytest.mark.parametrize("edit_via", ["gathered", "safe_set"])
def test_fragments_with_hpz(world, edit_via: str) -> None:
    """hpZ (2 of 4 ranks per node): the edits go through write_shard, which drops the secondary shards."""
    spec = _spec(3, accumulation=2).replace(extra_zero={"zero_hpz_partition_size": 2})
    results = world(4, env={"LOCAL_WORLD_SIZE": "2"}).run(fragments_run, spec, edit_via)
    compare(results, reference_run(spec, 4))
    _check_fragments(results, spec, 4)


def test_full_grad_is_unscaled_under_fp16(world) -> None:
    """fp16 with a loss scale of 2**8: ``safe_get_full_grad`` is the true gradient (fp16-close to the fp32
    reference), not the scaled one."""
    spec = _spec(3).replace(dtype="fp16", fp16={"initial_scale_power": 8}, edit=())
    results = world(2).run(fragments_run, spec, "safe_set")
    want = reference_grads(spec.replace(dtype="fp32"), 2, 0)
    for name, got in results[0]["grads"][0].items():
        if got is not None:
            scale = want[name].abs().max().item()
            torch.testing.assert_close(got, want[name], rtol=0.05, atol=0.02 * scale, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_set_optimizer_state_and_local_roundtrip(world, stage: int) -> None:
    got = world(3).run(set_state_roundtrip, _spec(stage))
    assert got == [{"full": True, "local": True, "fp32": True, "key_error": True}] * 3


@pytest.mark.parametrize(("stage", "editors"), [(3, (1,)), (0, (0,)), (0, (0, 1)), (2, (0, 1)), (1, (1,))])
def test_edit_without_modifier_raises_on_every_rank(world, stage: int, editors: tuple[int, ...]) -> None:
    """Stage 0 fp32 is the hard case: the parameter views the master itself, so the edit must be undone from a rank
    that did not make it (or, when every rank edited, from the master's other copies: re-derived as rank 0's)."""
    got = world(2).run(edit_without_modifier, _spec(stage), editors)
    if stage == 0 and editors == (0, 1):
        assert [g["raised"] for g in got] == [True, True]
        return  # every rank wrote its only copy: raised everywhere, ranks consistent (rank 0's value)
    assert got == [{"raised": True, "unchanged": True, "loss_same": True}] * 2


@pytest.mark.parametrize("stage", [3, 1])
def test_client_scheduler_object_steps_without_warnings(world, stage: int) -> None:
    """A scheduler built on the client optimizer (DeepSpeed-Chat passes HF's ``get_scheduler`` result) is re-pointed
    at the torch optimizer behind the engine: torch's step-order heuristic no longer warns on the engine's own,
    correctly ordered call, and the lrs follow the schedule (LambdaLR: 0.01 × 1 / (s + 1) after step s)."""
    got = world(2).run(client_scheduler_object, stage)
    assert got == [{"same_scheduler": True, "lrs": [0.01 * (1.0 / n) for n in (2, 3, 4)]}] * 2


def test_unowned_noop_and_two_engines(world) -> None:
    assert world(2).run(unowned_and_two_engines) == [{"unowned": True, "full_inside": True, "edited": True}] * 2


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_engine_is_a_module(world, stage: int) -> None:
    spec = RunSpec(model="gpt2_tied", stage=stage, persistence_threshold=50, accumulation=2)
    for res in world(2).run(module_surface, spec):
        assert res.pop("batch") == (8, 2, 2, stage, 2, True, False, False)
        assert res.pop("load") == ([], [], True)
        assert all(res.values()), res


def test_comm_face(world) -> None:
    got = world(3).run(comm_face)
    assert [g["rank"] for g in got] == [0, 1, 2]
    assert all(
        g["world"] == 3 and g["sum"] == 6.0 and g["gathered"] == [0.0, 1.0, 2.0] and g["bcast"] == 7.0 and g["init"]
        for g in got
    )


def test_initialize_with_args(world, tmp_path) -> None:
    got = world(2).run(initialize_with_args, str(tmp_path))
    assert (
        got
        == [{"args": (True, False, None), "tuple": (True, True, True), "micro": 2, "errors": [True, True, True]}] * 2
    )


def test_ds_attributes_of_zero3_parameters(world) -> None:
    """DeepSpeed's ``ds_id`` / ``ds_shape`` / ``ds_numel`` / ``ds_tensor`` / ``ds_status`` / ``ds_persist`` (read-only,
    computed from the engine; ``ds_status`` NOT_AVAILABLE at rest for sharded parameters, AVAILABLE inside a gather):
    the ranks' ``ds_tensor`` parts, in rank order, are the full fp32 value where the parameter is sharded (or each is
    the whole value where it is persistent); stage 2 parameters have none."""
    pool = world(2)
    spec = _spec(3)
    got = pool.run(ds_attributes, spec)
    full = {n: p.detach() for n, p in build_model(spec).named_parameters()}  # the engine's start values
    for r in got:
        checks = ("write_lost", "status", "shape", "ids", "persist", "local", "copy_unowned", "destroyed", "summary")
        assert all(r[c] for c in checks), {c: r[c] for c in checks}
    for name, value in full.items():
        parts = [r["parts"][name] for r in got]
        whole = value.reshape(-1)
        assert torch.equal(torch.cat(parts), whole) or all(torch.equal(p, whole) for p in parts), name
    assert pool.run(ds_attributes, _spec(2)) == [{"none": True}] * 2


def test_unwrap_model_for_generation(world) -> None:
    """``deepspeed.runtime.zero.unwrap_model_for_generation(engine)`` (what DeepSpeed's ``test_unwrap_model.py`` and
    TRL-style loops call between steps): parameters whole inside, no collective while generating, partitioned after,
    every submodule's train/eval mode kept (inside and after); ``engine.generate`` inside it is re-entrant (same
    tokens as the module's, still no collective); the training around it is bitwise the same run without it;
    passing ``engine.module`` is a clear error."""
    pool = world(2)
    spec = _spec(3)
    with_unwrap = pool.run(unwrap_for_generation, spec, True)
    plain = pool.run(unwrap_for_generation, spec, False)
    for a, b in zip(with_unwrap, plain):
        assert all(a["checks"]) and len(a["checks"]) == 4 * spec.steps + 1, a["checks"]
        assert torch.equal(a["losses"], b["losses"])
        assert len(a["tokens"]) == spec.steps and all(len(t) == 3 for t in a["tokens"])


def test_empty_partition_cache_frees_persistent_parameters(world) -> None:
    """``engine.empty_partition_cache()`` frees the persistent parameters too, as DeepSpeed's does (its
    ``TestZeroPartitionCache`` expects every parameter size 0 after it): after a step and between a forward and its
    backward, every parameter is size 0 and the persistent ones answer NOT_AVAILABLE; a module holding only
    persistent parameters called directly, the state dict, ``GatheredParameters``, the next forward and the backward
    bring them back; the training is bitwise the run that never empties the cache."""
    pool = world(2)
    spec = RunSpec(model="llama", steps=3, stage=3, persistence_threshold=50)
    evicted = pool.run(evicting_run, spec)
    plain = pool.run(engine_run, spec)
    for a, b in zip(evicted, plain):
        assert all(a["probes"].values()) and len(a["probes"]) == 7, a["probes"]
        assert a["losses"] == [loss for step in b["losses"] for loss in step]
    for name, value in plain[0]["params"].items():
        assert torch.equal(evicted[0]["params"][name], value), name
