"""Bad input fails fast and loud on every rank; a rank that dies mid-step does not hang its peers."""
from __future__ import annotations

import time

import pytest

from tests.workers.failures import init_with_bad_config_on, step_fails_on
from tests.harness.spawn import RemoteError


@pytest.mark.parametrize(("bad", "words"), [
    ({"zero_optimization": {"stage": 4}}, ["zero_optimization.stage", "4"]),
    ({"train_batch_size": 7}, ["train_batch_size", "7"]),
    ({"zero_optimization": {"stage": 3, "reduce_bucket_size": -5}}, ["reduce_bucket_size", "-5"]),
    ({"optimizer": {"type": "Adamax", "params": {}}}, ["Adamax"]),
    ({"zero_optimisation": {"stage": 3}}, ["zero_optimisation", "zero_optimization"]),
])
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
