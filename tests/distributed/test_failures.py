"""Bad input fails fast and loud on every rank; a rank that dies mid-step does not hang its peers."""

from __future__ import annotations

import time

import pytest
import torch

from tests.harness.spawn import RemoteError
from tests.workers.failures import (
    FAILING_RANK,
    caught_failure_then_continue,
    gathered_body_fails_on_one_rank,
    generate_fails_on_one_rank,
    init_with_bad_config_on,
    nonfinite_loss_run,
    step_fails_on,
)


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({"zero_optimization": {"stage": 4}}, ["zero_optimization.stage", "4"]),
        ({"train_batch_size": 7}, ["train_batch_size", "7"]),
        ({"zero_optimization": {"stage": 3, "reduce_bucket_size": -5}}, ["reduce_bucket_size", "-5"]),
        ({"optimizer": {"type": "Adamax", "params": {}}}, ["Adamax"]),
        ({"zero_optimisation": {"stage": 3}}, ["zero_optimisation", "zero_optimization"]),
    ],
)
def test_config_error_on_one_rank_reaches_every_rank(world, bad: dict, words: list[str]) -> None:
    pool = world(2)
    with pytest.raises(RemoteError) as info:
        pool.run(init_with_bad_config_on, 1, bad, timeout=120)
    assert set(info.value.failures) == {0, 1}, "both ranks must raise, neither may hang"
    for rank in (0, 1):
        text = info.value.failures[rank]
        assert "ConfigError" in text and all(w in text for w in words), text
    assert "raised on rank 1" in info.value.failures[0]
    assert not pool.broken


def test_rank_failing_mid_step_does_not_hang_peers(world) -> None:
    pool = world(3, env={"HYBRIDZERO_TEST": "failure"})
    start = time.monotonic()
    with pytest.raises(RemoteError) as info:
        pool.run(step_fails_on, 2, timeout=180)
    elapsed = time.monotonic() - start
    failures = info.value.failures
    assert "IndexError" in failures.get(2, "") or "index" in failures.get(2, "").lower()
    for rank in (0, 1):
        assert rank in failures and "PeerFailure" in failures[rank] and "rank 2" in failures[rank], failures
    assert elapsed < 120
    pool.close()  # the failing rank tore its process group down: this pool is spent


_FAILURE_ENV = {"HYBRIDZERO_TEST": "failure"}  # these runs tear their process group down: a pool of their own


_PG_TIMEOUT_S = 120.0  # the pool's gloo timeout: a report that came from it would take at least this long


@pytest.mark.parametrize(
    ("where", "timing", "error"),
    [
        ("forward", "slow", "IndexError"),
        ("module_forward", "slow", "IndexError"),
        pytest.param("backward", "fast", "injected failure in backward", marks=pytest.mark.slow),  # a fresh pool each
        ("backward", "slow", "injected failure in backward"),
        ("step", "fast", "injected failure in optimizer step"),
    ],
)
def test_caught_failure_reaches_every_rank_at_its_next_collective(world, where: str, timing: str, error: str) -> None:
    """One rank fails inside an engine call (or a direct module forward) and carries on. The peer raises
    PeerFailure naming that rank and error at its next collective, whether it was already waiting ("slow") or
    starts after the failure ("fast"), long before the collective timeout; the failing rank's own next collective
    is refused. Nothing is silently paired with a different collective, and neither rank hangs."""
    pool = world(2, env=_FAILURE_ENV)
    seen = pool.run(caught_failure_then_continue, where, timing, timeout=180)
    peer, failing = seen[1 - FAILING_RANK], seen[FAILING_RANK]
    assert error in failing["caught"], failing
    assert failing["next"].startswith("PeerFailure") and "refused" in failing["next"], failing
    assert peer["next"].startswith("PeerFailure"), peer
    assert f"rank {FAILING_RANK}: " in peer["next"] and error in peer["next"], peer
    assert peer["seconds"] < _PG_TIMEOUT_S / 2, peer  # not the timeout path
    assert pool.broken, seen  # the workers' process group is gone: the fixture starts a fresh pool next time


@pytest.mark.parametrize("kind", ["bucketed", "module", "tp"])
def test_exception_inside_zero3_generate_reaches_every_rank(world, kind: str) -> None:
    """ZeRO-3 generation over the hooks (HF synced generation) or tensor-parallel generation (the peer waits in the
    group's collectives), one rank raises and catches: the other rank raises
    PeerFailure naming it at once instead of waiting for the collective timeout; both are then clearly failed (the
    next engine call is refused)."""
    pool = world(2, env=_FAILURE_ENV)
    seen = pool.run(generate_fails_on_one_rank, kind, timeout=180)
    peer, failing = seen[1 - FAILING_RANK], seen[FAILING_RANK]
    assert "injected failure" in failing["outcome"], failing
    assert peer["outcome"].startswith("PeerFailure") and f"rank {FAILING_RANK}: " in peer["outcome"], peer
    assert "injected failure" in peer["outcome"] and peer["seconds"] < _PG_TIMEOUT_S / 2, peer
    for rank in seen:
        assert rank["failed"] and rank["next"].startswith("PeerFailure"), rank
    assert pool.broken


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_nonfinite_loss_on_one_rank_skips_the_step_everywhere(world, dtype: str) -> None:
    """Rank 1's loss is NaN at step 1. With ``skip_nonfinite_steps`` every rank skips that step (one MAX all-reduce,
    the fp16 overflow agreement) and the master weights are bitwise those of a run that never had step 1, all
    finite; the skip is counted. Without it (today's default) the NaN reaches every master weight."""
    pool = world(2)
    skipped = pool.run(nonfinite_loss_run, dtype, True, 1, None)
    without = pool.run(nonfinite_loss_run, dtype, True, None, 1)
    for res in skipped:
        assert res["applied"] == [True, False, True, True]
        assert (res["skipped"], res["nonfinite_skipped"], res["global_steps"]) == (1, 1, 4)
    assert all(res["applied"] == [True] * 3 and res["skipped"] == 0 for res in without)
    assert skipped[0]["params"].keys() == without[0]["params"].keys()
    for name, value in without[0]["params"].items():
        assert torch.isfinite(skipped[0]["params"][name]).all(), name
        assert torch.equal(skipped[0]["params"][name], value), name
    off = pool.run(nonfinite_loss_run, dtype, False, 1, None)
    assert all(res["applied"] == [True] * 4 and res["skipped"] == 0 for res in off)
    assert all(torch.isnan(value).any() for value in off[0]["params"].values())


@pytest.mark.parametrize("modifier", [True, False])
def test_failure_inside_gathered_parameters_reaches_every_rank(world, modifier: bool) -> None:
    """A body that raises on one rank inside ``zero.GatheredParameters`` fails the group: the peer's exit collective
    (the modifier's broadcast, or the unowned-edit agreement) raises PeerFailure naming that rank and error instead
    of pairing with the failing rank's next collective, and the failing rank's next collective is refused."""
    pool = world(2, env=_FAILURE_ENV)
    seen = pool.run(gathered_body_fails_on_one_rank, modifier, timeout=180)
    peer, failing = seen[1 - FAILING_RANK], seen[FAILING_RANK]
    assert "injected failure inside GatheredParameters" in failing["caught"], failing
    assert failing["next"].startswith("PeerFailure") and "refused" in failing["next"], failing
    assert peer["next"].startswith("PeerFailure") and f"rank {FAILING_RANK}: " in peer["next"], peer
    assert "injected failure inside GatheredParameters" in peer["next"], peer
    assert pool.broken, seen
