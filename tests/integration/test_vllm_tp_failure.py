"""A vLLM failure inside a tensor-parallel group (``inference_tp_size`` 2 at world 2, under ``torchrun``): no hang,
no orphan process (hybridzero.rlhf.rollout.backends.tp_failure; the worker: tests/workers/vllm_tp_failure.py).

* Failure on one rank mid-generation: its peer is blocked in vLLM's own collectives. The failing rank gives the job
  up after its report wait (3 s here) instead of the process group's timeout (120 s here): it raises
  ``GroupAbandoned`` naming the failure and tears the process group down; torchrun ends the job (non-zero status)
  and no worker process is left. The peer either raises ``PeerFailure`` naming rank 1's failure (here: vLLM's CPU
  collectives ran on a gloo group, which the teardown broke) or is ended by the launcher (a collective nothing
  breaks, e.g. a shared-memory all-reduce). Without the protocol the failing rank would wait in the agreement
  collective until the timeout, and the peer in vLLM's: the launch's time limit below would fail the test.
* Failure on both ranks before any collective: every rank reports, so the ranks raise together through the
  ordinary agreement (the injected error, no ``GroupAbandoned``) and the processes end normally."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.hf_common import ENV, REPO

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow

WORKER = "tests.workers.vllm_tp_failure"


def _launch(mode: str, out: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", WORKER]
    env = {**ENV, "HYBRIDZERO_TIMEOUT_S": "120"}
    return subprocess.run(
        [*cmd, mode, str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=480, check=False
    )


def _workers_left() -> list[int]:
    """Processes still running the worker module (its ranks; none may outlive the launch)."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if WORKER in cmdline and int(pid) != os.getpid():
            left.append(int(pid))
    return left


def _record(out: Path, rank: int) -> dict[str, object] | None:
    path = out / f"rank{rank}.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="the orphan check reads /proc")
def test_failure_on_one_rank_ends_the_job_without_waiting(tmp_path: Path) -> None:
    proc = _launch("one", tmp_path)
    log = f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode != 0, log
    failed = _record(tmp_path, 1)
    assert failed is not None, log
    error = str(failed["error"])
    assert error.startswith("GroupAbandoned: vLLM generation failed on rank 1"), error
    assert "injected vLLM failure on rank 1" in error and "did not report within 3 s" in error, error
    peer = _record(tmp_path, 0)
    if peer is not None:  # vLLM's collective ran on a gloo group the teardown broke: the peer raised, naming it
        assert str(peer["error"]).startswith("PeerFailure:"), peer
        assert "injected vLLM failure on rank 1" in str(peer["error"]), peer
    assert _workers_left() == [], log  # else the launcher ended it


def test_failure_on_every_rank_is_raised_together(tmp_path: Path) -> None:
    proc = _launch("both", tmp_path)
    log = f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, log
    for rank in (0, 1):
        record = _record(tmp_path, rank)
        assert record is not None, log
        error = str(record["error"])
        assert "injected vLLM failure on rank" in error and "GroupAbandoned" not in error, error
