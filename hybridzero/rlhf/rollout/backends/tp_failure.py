"""A vLLM failure on one rank of a tensor-parallel group: reported to every rank, never waited on for good.

The ranks of an ``inference_tp_size`` group run one vLLM engine together; inside its decode they meet in vLLM's own
tensor-parallel collectives (gloo or a shared-memory all-reduce on CPU, NCCL on GPU), which neither look at the
project's failure store nor time out early. An exception on one rank therefore leaves its peers blocked there, and
the project's agreement after generation (one ``all_gather_object``) would wait for them until the process group's
timeout. Protocol, once per generation call (the calls are numbered alike on every rank of a group):

1. each rank, done with its call (answers or an exception), leaves ``ok`` or its error in the rendezvous store under
   ``hybridzero/vllm_tp/<group's first rank>/<call>/<rank>`` (no collective);
2. a rank whose call raised waits up to ``failure_wait_s`` for every peer's report. All reported (the failure came
   from the shared inputs, so every rank failed alike, or the peers finished first): it goes on to the caller's
   agreement, which raises the same error on every rank of the world;
3. a peer did not report: it is blocked in vLLM's collectives. This rank posts its error and tears the process
   group down (:meth:`~hybridzero.comm.collectives.Comm.fail`: a rank waiting in one of the project's collectives
   raises ``PeerFailure`` naming it; a peer in a vLLM collective over gloo, as on CPU here, is freed by the teardown,
   reports late and raises that ``PeerFailure`` too), stops its engine and raises :class:`GroupAbandoned`, after
   arming a watchdog that ends the process ``EXIT_AFTER_S`` later if unwinding has not. The launcher (``torchrun``)
   then ends the job, with any peer still blocked (a collective nothing breaks: shared memory, NCCL). No hang, no
   orphan (the reward worker dies with its parent).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from hybridzero.comm.failures import describe
from hybridzero.rlhf.rollout.backends.base import RolloutEngineError

__all__ = ["EXIT_AFTER_S", "EXIT_CODE", "GroupAbandoned", "REPORT_KEY", "settle_group_call"]

REPORT_KEY = "hybridzero/vllm_tp"
EXIT_CODE = 70  # the process's status when the watchdog ends it
EXIT_AFTER_S = 15.0
_POLL_S = 0.05
_LOG = logging.getLogger("hybridzero")


class GroupAbandoned(RolloutEngineError):
    """vLLM failed on this rank while peers of its tensor-parallel group stay blocked in vLLM's collectives."""


def _report(store: Any, key: str, status: str) -> None:
    try:
        store.set(key, status)
    except Exception:  # noqa: BLE001 - a report must never mask the error it carries
        pass


def _all_reported(store: Any, keys: list[str], wait_s: float) -> bool:
    """Whether every key appears in the store within ``wait_s`` seconds (polled)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if store.check(keys):
                return True
        except Exception:  # noqa: BLE001 - the store went away with the rank that served it
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)


def settle_group_call(engine: Any, error: BaseException | None) -> BaseException | None:
    """Run the module's protocol for one generation call of ``engine`` (a
    :class:`~hybridzero.rlhf.rollout.backends.vllm_engine.VLLMEngine` whose ``group`` has more than one rank) that
    ended with ``error`` (``None``: answers). Returns ``error`` for the caller's agreement, or raises
    :class:`GroupAbandoned` (step 3)."""
    group = engine.group
    store = group.store
    call, engine.tp_calls = engine.tp_calls, engine.tp_calls + 1
    rank = int(engine.rank)  # global; a group is consecutive ranks (vllm_tp)
    first = rank - group.rank
    base = f"{REPORT_KEY}/{first}/{call}"
    if store is None:
        return error
    _report(store, f"{base}/{rank}", "ok" if error is None else f"error: {describe(error)}")
    if call > 0:  # the previous call's report is settled on every rank by now: keep the store small
        try:
            store.delete_key(f"{REPORT_KEY}/{first}/{call - 1}/{rank}")
        except Exception:  # noqa: BLE001 - housekeeping only
            pass
    if error is None:
        return None
    peers = [f"{base}/{first + r}" for r in range(group.world_size)]
    wait_s = float(engine.opts.failure_wait_s)
    if _all_reported(store, peers, wait_s):
        return error
    abandoned = GroupAbandoned(
        f"vLLM generation failed on rank {rank} ({describe(error)}); its inference_tp_size group's other ranks did "
        f"not report within {wait_s:g} s: they are blocked in vLLM's own tensor-parallel collectives. The process "
        f"group is torn down and this process exits (status {EXIT_CODE} within {EXIT_AFTER_S:g} s) so that the "
        "launcher ends the job"
    )
    abandoned.__cause__ = error
    _LOG.error("%s", abandoned)
    group.fail(abandoned)  # post it, refuse further collectives, tear the process group down
    engine.stop()
    watchdog = threading.Timer(EXIT_AFTER_S, os._exit, args=(EXIT_CODE,))
    watchdog.daemon = True
    watchdog.start()
    raise abandoned
