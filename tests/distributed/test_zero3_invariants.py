"""Prefetch is a hint (bitwise-identical results), bytes match the theory, bf16 tracks fp32, quiescence holds."""

from __future__ import annotations

import pytest
import torch

from hybridzero.zero.layout import build_layout
from hybridzero.zero.partition import plan_groups
from tests.harness.parity import RunSpec, build_model, engine_run, reference_run, step_losses
from tests.workers.phases import reuse_after_forward_only_probe


def _same(a: list[dict], b: list[dict]) -> None:
    assert [r["losses"] for r in a] == [r["losses"] for r in b]
    for name, value in a[0]["params"].items():
        assert torch.equal(value, b[0]["params"][name]), name


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("model", ["llama", "gpt2_tied"])
def test_prefetch_off_small_large_bitwise_identical(world, world_size: int, model: str) -> None:
    base = RunSpec(model=model, steps=3, accumulation=2, clipping=0.5)
    pool = world(world_size)
    off = pool.run(engine_run, base.replace(prefetch_bucket_size=0))
    small = pool.run(engine_run, base.replace(prefetch_bucket_size=12_000))
    large = pool.run(engine_run, base.replace(prefetch_bucket_size=10**9, overlap_comm=True, reduce_bucket_size=3000))
    _same(off, small)
    _same(off, large)
    assert off[0]["prefetches"] == 0
    assert small[0]["prefetches"] > 0 and large[0]["prefetches"] > small[0]["prefetches"]
    assert all(r["invalidations"] == 0 for r in small + large)  # same order every step: the trace holds


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bytes_per_step_match_theory(world, world_size: int) -> None:
    """All-gather: forward + backward gather every sharded group once; reduce-scatter: every group once."""
    spec = RunSpec(model="opt", steps=1, with_scalar=True)
    results = world(world_size).run(engine_run, spec)
    model = build_model(spec)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    padded = [
        build_layout(plan.param_names, [shapes[n] for n in plan.param_names], world_size).padded_numel
        for plan in plan_groups(model, spec.persistence_threshold)
    ]
    expected = 4 * sum(padded)  # fp32 bytes of one gather of every group
    for r in results:
        totals = {}
        for row in r["ledger"]:
            key = (row["collective"], row["phase"])
            totals[key] = totals.get(key, 0) + row["bytes"]
        assert totals[("all_gather", "forward")] == pytest.approx(expected, rel=0.02)
        assert totals[("all_gather", "backward")] == pytest.approx(expected, rel=0.02)
        assert totals[("reduce_scatter", "backward")] == pytest.approx(expected, rel=0.02)
        calls = {row["collective"]: 0 for row in r["ledger"]}
        for row in r["ledger"]:
            calls[row["collective"]] += row["calls"]
        assert calls["all_gather"] == 2 * len(padded)  # nothing gathered twice, nothing extra


def test_prefetch_batches_are_one_coalesced_gather(world) -> None:
    """With a trace, a prefetch decision's groups go out as one all-gather: the same bytes as separate gathers in
    fewer calls (and prefetch off, with one call per group, gives bitwise the same run)."""
    runs = {
        bucket: world(2).run(engine_run, RunSpec(model="llama", steps=3, prefetch_bucket_size=bucket))
        for bucket in (0, 10**9)
    }
    for a, b in zip(runs[0], runs[10**9]):
        assert a["losses"] == b["losses"]

    def forward(r: dict) -> tuple[int, int]:
        rows = [x for x in r["ledger"] if x["collective"] == "all_gather" and x["phase"] == "forward"]
        return sum(x["calls"] for x in rows), sum(x["bytes"] for x in rows)

    (calls_off, bytes_off), (calls_on, bytes_on) = forward(runs[0][0]), forward(runs[10**9][0])
    assert bytes_on == bytes_off
    # 3 groups (root + 2 blocks), 3 steps: step 0 has no trace (3 calls); in later steps the root, needed now, and
    # both blocks the trace prefetches go out in one call
    assert calls_off == 3 * 3 and calls_on == 3 + 2 * 1


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("model", ["llama", "gpt2_tied"])
def test_bf16_tracks_fp32_reference(world, world_size: int, model: str) -> None:
    """bf16 compute (fp32 master weights, fp32 reduction): losses within 2% of fp32, parameters close."""
    spec = RunSpec(model=model, steps=4, dtype="bf16", lr=1e-3, accumulation=2, clipping=1.0)
    results = world(world_size).run(engine_run, spec)
    ref = reference_run(spec.replace(dtype="fp32"), world_size)
    for a, b in zip(step_losses(results), ref["losses"]):
        assert abs(a - b) <= 0.02 * abs(b)
    for name, value in ref["params"].items():
        diff = (results[0]["params"][name] - value).abs().max().item()
        assert diff <= 5e-3, f"{name}: {diff}"


def test_reuse_rule_gathers_once_per_step_with_identical_results(world) -> None:
    """DeepSpeed's default reuse distance keeps groups gathered from forward into backward once the trace is known:
    after the first step no backward gathers; with ``stage3_max_reuse_distance: 0`` every group is gathered again,
    unless the prefetch bucket holds it (DeepSpeed's prefetcher keeps what it would fetch again);
    a ``stage3_max_live_parameters`` budget limits what is kept; results are bitwise identical in all three."""
    base = RunSpec(model="llama", steps=3, accumulation=2, clipping=0.5)
    pool = world(2)
    runs = {
        name: pool.run(engine_run, base.replace(extra_zero=extra))
        for name, extra in {
            "keep": {},
            "release": {"stage3_max_reuse_distance": 0},
            "budget": {"stage3_max_live_parameters": 12_000},
            # DeepSpeed's prefetcher leaves gathered what it would fetch again within its bucket: no reuse
            # distance, but a bucket holding the model, keeps everything as the default does
            "bucket": {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 10**8},
        }.items()
    }
    _same(runs["keep"], runs["release"])
    _same(runs["keep"], runs["budget"])
    _same(runs["keep"], runs["bucket"])

    def backward_gathers(res: list[dict]) -> int:
        return sum(
            row["calls"] for row in res[0]["ledger"] if row["collective"] == "all_gather" and row["phase"] == "backward"
        )

    groups = len(runs["keep"][0]["group_numels"])
    assert backward_gathers(runs["release"]) == 6 * groups  # 3 steps x 2 micro-steps, every group again
    assert backward_gathers(runs["keep"]) == groups  # only the first micro-step (no trace yet)
    assert backward_gathers(runs["bucket"]) == groups
    assert groups < backward_gathers(runs["budget"]) < 6 * groups


def test_reuse_rule_needs_a_backward_after_the_previous_forward(world) -> None:
    """DeepSpeed's reuse rule keeps groups for the backward only while the previous grad-enabled forward was
    followed by one: after a forward without a backward, the next forwards release every group at their end (what
    was kept is released too), until a backward comes again; results are bitwise those of reuse distance 0."""
    pool = world(2)
    keep = pool.run(reuse_after_forward_only_probe, 1_000_000_000)
    release = pool.run(reuse_after_forward_only_probe, 0)
    groups = 3  # root + 2 blocks
    for r in keep:
        # step 0: no trace yet; 1: kept for its backward; 2: the previous forward had a backward, so kept (and then
        # dropped by the next forward); 3, 4: no backward after the previous forward; 5: neither; 6: kept again
        assert r["kept"] == [0, groups, groups, 0, 0, 0, groups], r["kept"]
    for r in release:
        assert r["kept"] == [0] * 7
    for a, b in zip(keep, release):
        assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
    for name, value in keep[0]["params"].items():
        assert torch.equal(value, release[0]["params"][name]), name
