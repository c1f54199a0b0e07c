"""How an engine call ends when it raises: every rank raises together, or the process group is failed everywhere.

Invariant: an exception that escapes a call which issues collectives is either agreed (every rank raised it at the
same point, :meth:`Comm.agree`) or fails the group (:meth:`Comm.fail`), so no rank goes on issuing collectives that
pair with a peer's different ones. See "Failures" in docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

import torch

from hybridzero.comm.collectives import Comm


@contextlib.contextmanager
def failure_guard(comm: Comm) -> Iterator[None]:
    """Re-raise any exception after :meth:`Comm.fail`: unless every rank agreed on it, the failure is posted and this
    rank issues no further collective, so each peer raises :class:`PeerFailure` at its pending or next collective
    (however fast)."""
    try:
        yield
    except Exception as exc:
        comm.fail(exc)
        raise


def leave_synced_generation(comm: Comm, exc: BaseException, device: torch.device) -> None:
    """After ``exc`` escaped Hugging Face's synced generation (``synced_gpus``) on this rank, before the guard fails it
    (call it only when generation was synced: otherwise no peer waits in that all-reduce).

    HF all-reduces a "still generating" flag (SUM; 0 means every rank is done) before each decode step, with a raw
    collective no poll can watch. An exception between two forwards (a logits processor, a stopping criterion)
    leaves every peer waiting there: post the failure, then join that one all-reduce as a finished rank, so each peer
    either runs its next forward (whose first collective, the synced-generation guard's exchange, blocks and reports
    the failure) or leaves generate and reports it at its next collective. The guard's owed close is dropped: this
    rank fails the group instead. After a failed forward nothing is joined: the coordinator has already failed the
    group and the peers wait in gathers, which poll.
    """
    if comm.world_size == 1 or comm.failures.failed is not None:
        return
    comm.post_failure("".join(traceback.format_exception_only(type(exc), exc)).strip())
    comm.failures.owed = None  # the synced-generation guard's close: this rank fails the group instead
    finished = torch.zeros((), dtype=torch.float32, device=device)
    comm.all_reduce(finished, phase="generate")
