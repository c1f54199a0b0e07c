"""The one wrapper through which every collective goes (the only importer of ``torch.distributed``).

Invariants:
* Every call is recorded in the owning :class:`~hybridzero.comm.ledger.Ledger` (calls, whole-buffer bytes, wire
  bytes), before it is issued, with the engine phase the caller names.
* An asynchronous call returns a :class:`PendingCollective`; whoever holds it must ``wait()`` it exactly once (the
  zero layer stores it in the one group object that owns the buffer). There is no "in flight" state without a handle.
* A failure on one rank is posted to the rendezvous store; a peer whose collective then breaks (the failing rank
  tore its process group down, or the collective timed out) raises :class:`PeerFailure` naming that rank and error,
  instead of hanging.
* At world size 1 without a process group the collectives are local copies, still recorded.
"""
from __future__ import annotations

import datetime
import gc
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hybridzero.comm.ledger import Ledger

_FAILURE_KEY = "hybridzero/failure"
DEFAULT_TIMEOUT_S = 600.0
_POLL_CHECK_S = 1.0


class PeerFailure(RuntimeError):
    """A collective could not complete because another rank failed (its rank and error are in the message)."""


class PendingCollective:
    """Handle of one issued collective. ``wait()`` completes it; calling it again is a no-op."""

    def __init__(self, comm: "Comm", work: Any | None, on_done: Callable[[], None] | None = None) -> None:
        self._comm = comm
        self._work = work
        self._on_done = on_done
        self._done = work is None and on_done is None

    @property
    def done(self) -> bool:
        """True once ``wait()`` has returned."""
        return self._done

    def wait(self) -> None:
        """Block until the collective is complete (and run its completion step once)."""
        if self._done:
            return
        if self._work is not None:
            self._comm._wait(self._work)
        if self._on_done is not None:
            self._on_done()
        self._done = True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Initialise the default process group from torchrun's environment (idempotent).

    gloo on CPU, NCCL when CUDA is available (``backend`` overrides). Without torchrun's variables a plain process
    becomes a world of size 1. ``timeout_s`` (default ``$HYBRIDZERO_TIMEOUT_S`` or 600) bounds every collective, so a
    dead peer turns into an error instead of a hang.
    """
    if dist.is_available() and dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if timeout_s is None:
        timeout_s = float(os.environ.get("HYBRIDZERO_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(backend, rank=0, world_size=1, timeout=timeout)
        return
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timeout)


def _world_info(group: Any | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


class Comm:
    """Collectives over one process group (``None`` = the default group), recorded in ``ledger`` under ``name``."""

    def __init__(self, ledger: Ledger, group: Any | None = None, name: str = "world") -> None:
        self.ledger = ledger
        self.group = group
        self.name = name
        self.rank, self.world_size = _world_info(group)
        self._local = not (dist.is_available() and dist.is_initialized())
        self._poll = not self._local and dist.get_backend(group) == "gloo"
        self.failure_key = _FAILURE_KEY  # scoped per engine by ``scope_failures`` so old failures never leak

    # --- sub-groups --------------------------------------------------------------------------------------------
    def split(self, rank_lists: list[list[int]], name: str) -> "Comm":
        """A Comm over the sub-group of ``rank_lists`` that contains this rank (every rank must call this)."""
        if self._local:
            return Comm(self.ledger, None, name)
        mine = None
        for ranks in rank_lists:
            pg = dist.new_group(ranks=ranks)
            if dist.get_rank() in ranks:
                mine = pg
        return Comm(self.ledger, mine, name)

    # --- tensor collectives -------------------------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, phase: str, async_op: bool = False,
                   label: str = "all_gather") -> PendingCollective:
        """Gather equal shards ``inp`` of every rank into ``out`` (rank-major, ``out.numel() == W * inp.numel()``).
        ``label`` names the use in the ledger when it is not a parameter gather (e.g. "grad_all_gather")."""
        w = self.world_size
        nbytes = out.numel() * out.element_size()
        self.ledger.record(label, self.name, phase, nbytes, nbytes * (w - 1) // w)
        if w == 1:
            out.copy_(inp.view_as(out))
            return PendingCollective(self, None)
        work = dist.all_gather_single(out, inp, group=self.group, async_op=True)
        return self._finish(work, async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, *, phase: str, async_op: bool = False) -> PendingCollective:
        """Sum ``inp`` (rank-major, ``W * out.numel()``) over ranks; this rank receives its slice in ``out``."""
        w = self.world_size
        nbytes = inp.numel() * inp.element_size()
        self.ledger.record("reduce_scatter", self.name, phase, nbytes, nbytes * (w - 1) // w)
        if w == 1:
            out.copy_(inp.view_as(out))
            return PendingCollective(self, None)
        work = dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return self._finish(work, async_op)

    def exchange_for_reduce(self, recv: torch.Tensor, inp: torch.Tensor, *, phase: str,
                            async_op: bool = False) -> PendingCollective:
        """The communication half of an order-deterministic reduce-scatter.

        ``inp`` is rank-major ``[W * S]``; afterwards ``recv`` (``[W * S]``) holds, in rank order, the ``W`` slices
        that every rank sent for this rank's part. The caller sums them in rank order, so the result is bitwise
        independent of the transport's reduction algorithm. Moves exactly the bytes of a reduce-scatter and is
        recorded as one.
        """
        w = self.world_size
        nbytes = inp.numel() * inp.element_size()
        self.ledger.record("reduce_scatter", self.name, phase, nbytes, nbytes * (w - 1) // w)
        if w == 1:
            recv.copy_(inp)
            return PendingCollective(self, None)
        work = dist.all_to_all_single(recv, inp, group=self.group, async_op=True)
        return self._finish(work, async_op)

    def all_reduce(self, t: torch.Tensor, *, phase: str, op: str = "sum", async_op: bool = False) -> PendingCollective:
        """In-place all-reduce of ``t`` with ``op`` in {"sum", "max", "min"}."""
        w = self.world_size
        nbytes = t.numel() * t.element_size()
        self.ledger.record("all_reduce", self.name, phase, nbytes, 2 * nbytes * (w - 1) // w)
        if w == 1:
            return PendingCollective(self, None)
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        work = dist.all_reduce(t, op=red, group=self.group, async_op=True)
        return self._finish(work, async_op)

    def broadcast(self, t: torch.Tensor, src: int, *, phase: str) -> None:
        """Broadcast ``t`` from group rank ``src`` in place."""
        w = self.world_size
        nbytes = t.numel() * t.element_size()
        self.ledger.record("broadcast", self.name, phase, nbytes, nbytes if self.rank == src and w > 1 else 0)
        if w == 1:
            return
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        self._finish(dist.broadcast(t, global_src, group=self.group, async_op=True), False)

    # --- object collectives (metadata, agreement) --------------------------------------------------------------
    def all_gather_object(self, obj: Any, *, phase: str) -> list[Any]:
        """Every rank's ``obj``, in rank order (pickled; used for metadata and error agreement only)."""
        self.ledger.record("all_gather_object", self.name, phase, 0, 0)
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as exc:
            self._raise_peer_failure(exc)
        return out

    def barrier(self, *, phase: str) -> None:
        """Wait until every rank of the group arrives."""
        self.ledger.record("barrier", self.name, phase, 0, 0)
        if self.world_size > 1:
            self._finish(dist.barrier(group=self.group, async_op=True), False)

    # --- failure propagation ------------------------------------------------------------------------------------
    def scope_failures(self, scope: str) -> None:
        """Use a failure key of this engine's own (every rank passes the same ``scope``)."""
        self.failure_key = f"{_FAILURE_KEY}/{scope}"

    def post_failure(self, message: str) -> None:
        """Tell every peer that this rank failed with ``message`` (best effort; never raises)."""
        if self._local:
            return
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(self.failure_key, f"rank {dist.get_rank()}: {message}")
        except Exception:  # noqa: BLE001 - reporting a failure must never mask it
            pass

    def peer_failure(self) -> str | None:
        """The failure a peer posted, if any."""
        if self._local:
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
            if store.check([self.failure_key]):
                return store.get(self.failure_key).decode()
        except Exception:  # noqa: BLE001 - the store may be gone with the failed rank
            return None
        return None

    @property
    def polls(self) -> bool:
        """True when waits poll for posted peer failures (gloo)."""
        return self._poll

    def _finish(self, work: Any, async_op: bool) -> PendingCollective:
        handle = PendingCollective(self, work)
        if not async_op:
            handle.wait()
        return handle

    def _wait(self, work: Any) -> None:
        """Complete ``work``. On gloo (CPU) the wait polls, checking about once a second whether a peer posted a
        failure, so a rank blocked on a dead peer raises :class:`PeerFailure` instead of hanging; the fast path
        (already complete) costs one query. NCCL waits stay asynchronous with respect to the host."""
        if self._poll and not work.is_completed():
            next_check = time.monotonic() + _POLL_CHECK_S
            pause = 1e-5
            while not work.is_completed():
                time.sleep(pause)
                pause = min(pause * 2, 5e-4)
                if time.monotonic() >= next_check:
                    posted = self.peer_failure()
                    if posted is not None:
                        raise PeerFailure(f"collective on group '{self.name}' aborted because {posted}")
                    next_check += _POLL_CHECK_S
        try:
            work.wait()
        except RuntimeError as exc:
            self._raise_peer_failure(exc)

    def _raise_peer_failure(self, exc: BaseException) -> None:
        posted = self.peer_failure()
        if posted is not None:
            raise PeerFailure(f"collective on group '{self.name}' aborted because {posted}") from exc
        raise PeerFailure(f"collective on group '{self.name}' failed: {exc}") from exc


def abort_process_group() -> None:
    """Tear the default process group down so peers blocked on this rank fail fast (after ``post_failure``)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
            gc.collect()  # drop the last references so the transport closes its connections now
        except Exception:  # noqa: BLE001 - best effort while failing
            pass
