"""The step profile's accounting (``hybridzero/comm/timing.py``, ``bench/profile_parts.py``), with a hand-driven
clock: exclusive attribution of nested regions, the folding into parts, the check against the step time. No wall
time is asserted anywhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hybridzero.comm.collectives import Comm
from hybridzero.comm.ledger import Ledger
from hybridzero.comm.timing import KINDS, StepTimer, by_kind

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from profile_parts import (  # noqa: E402
    PARTS,
    accounting_error,
    check_accounting,
    comm_by_collective,
    part_of,
    step_parts,
    summarize,
)


class Clock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def test_nested_regions_are_charged_exclusively() -> None:
    clock = Clock()
    timer = StepTimer(clock)
    timer.enabled = True
    with timer.region("compute.backward"):
        clock.tick(3.0)
        with timer.region("hooks"):
            clock.tick(0.5)
            with timer.region("copy.grad"):
                clock.tick(0.25)
            with timer.region("wait.reduce_scatter"):
                clock.tick(1.0)
            clock.tick(0.125)
        clock.tick(2.0)
        with timer.region("hooks"):  # a second call of the same region adds up
            clock.tick(0.0625)
    assert timer.totals == {
        "copy.grad": 0.25,
        "wait.reduce_scatter": 1.0,
        "hooks": 0.5 + 0.125 + 0.0625,
        "compute.backward": 5.0,
    }
    assert sum(timer.totals.values()) == clock.now  # nothing counted twice, nothing lost
    assert timer.counts["hooks"] == 2
    assert by_kind(timer.totals) == {"compute": 5.0, "comm": 0.0, "copy": 0.25, "hooks": 0.6875, "wait": 1.0}


def test_region_closed_by_an_exception_is_still_charged() -> None:
    clock = Clock()
    timer = StepTimer(clock)
    timer.enabled = True
    with pytest.raises(RuntimeError), timer.region("compute.forward"):
        clock.tick(1.0)
        with timer.region("hooks"):
            clock.tick(2.0)
            raise RuntimeError("boom")
    assert timer.totals == {"compute.forward": 1.0, "hooks": 2.0}
    assert timer.take() == {"compute.forward": 1.0, "hooks": 2.0}
    assert timer.totals == {}


def test_disabled_timer_reads_no_clock_and_records_nothing() -> None:
    def clock() -> float:
        raise AssertionError("the clock was read while the timer is off")

    timer = StepTimer(clock)
    with timer.region("compute.forward"), timer.region("hooks"):
        pass
    assert timer.totals == {} and timer.counts == {}
    assert set(by_kind({})) == set(KINDS)


def test_world_one_collectives_are_timed_regions_of_the_ledger_timer() -> None:
    """A Comm without a process group: the local copies are charged to ``comm.<label>``, and the ledger still
    counts calls and bytes exactly as without the timer."""
    ledger = Ledger()
    comm = Comm(ledger)
    ledger.timer.enabled = True
    out = torch.empty(7)
    comm.all_gather(out, torch.arange(7.0), phase="forward")
    recv = torch.empty(5)
    comm.exchange_for_reduce(recv, torch.ones(5), phase="backward")
    assert torch.equal(out, torch.arange(7.0)) and torch.equal(recv, torch.ones(5))
    assert set(ledger.timer.totals) == {"comm.all_gather", "comm.reduce_scatter"}
    assert ledger.total("all_gather").calls == 1 and ledger.total("reduce_scatter").bytes == 20


def test_parts_fold_regions_and_reject_unknown_kinds() -> None:
    regions = {
        "compute.forward": 10.0,
        "compute.backward": 20.0,
        "compute.optimizer": 4.0,
        "comm.all_gather": 1.0,
        "comm.reduce_scatter.sum": 2.0,
        "wait.all_gather": 3.0,
        "wait.reduce_scatter": 0.5,
        "copy.grad": 1.5,
        "copy.cast": 0.25,
        "hooks": 0.75,
        "hooks.step": 0.25,
    }
    assert step_parts(regions) == {
        "compute": 30.0,
        "optimizer": 4.0,
        "comm": 3.0,
        "copies": 1.75,
        "hooks": 1.0,
        "idle": 3.5,
    }
    assert tuple(step_parts(regions)) == PARTS
    assert comm_by_collective(regions) == {"all_gather": 4.0, "reduce_scatter": 2.5}
    with pytest.raises(ValueError, match="'gpu.kernel' has no known kind"):
        part_of("gpu.kernel")


def test_accounting_check_flags_steps_outside_the_tolerance() -> None:
    regions = {"compute.forward": 90.0, "hooks": 6.0}
    assert accounting_error(regions, 100.0) == pytest.approx(0.04)
    good = {"rank": 0, "world_size": 2, "steps": [{"wall_ms": 100.0, "regions": regions}]}
    bad = {"rank": 1, "world_size": 2, "steps": [{"wall_ms": 110.0, "regions": regions}]}
    assert check_accounting([good], 0.05) == []
    (msg,) = check_accounting([good, bad], 0.05)
    assert "rank 1 of world 2, step 0" in msg and "96.00 ms of 110.00 ms" in msg
    with pytest.raises(ValueError, match="must be positive"):
        accounting_error(regions, 0.0)


def test_summary_takes_the_slowest_rank_per_step_and_mean_parts() -> None:
    def rank(r: int, walls: list[float], compute: float) -> dict[str, object]:
        steps = [{"wall_ms": w, "regions": {"compute.forward": compute, "wait.all_gather": w - compute}} for w in walls]
        return {"rank": r, "world_size": 2, "steps": steps}

    row = summarize("hybridzero", "fp32", [rank(0, [10.0, 30.0, 20.0], 8.0), rank(1, [12.0, 14.0, 40.0], 6.0)])
    assert row["world_size"] == 2
    assert row["step_walls_ms"] == [12.0, 30.0, 40.0] and row["median_step_ms"] == 30.0
    assert row["parts_ms"]["compute"] == 7.0
    assert row["parts_ms"]["idle"] == pytest.approx((2 + 22 + 12 + 6 + 8 + 34) / 6)
    assert row["unaccounted_ms"] == pytest.approx(0.0)
