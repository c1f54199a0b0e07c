"""The one wrapper through which every collective of the engine goes (with ``comm/__init__.py``, whose public
functions are DeepSpeed's ``deepspeed.comm`` face, and ``comm/process_group.py``, the only importers of
``torch.distributed``).

Invariants:
* Every call is recorded in the owning :class:`~hybridzero.comm.ledger.Ledger` (calls, whole-buffer bytes, wire
  bytes), before it is issued, with the engine phase the caller names.
* An asynchronous call returns a :class:`PendingCollective`; whoever holds it must ``wait()`` it exactly once (the
  zero layer stores it in the one group object that owns the buffer). There is no "in flight" state without a handle.
* A failure is fatal to the process group unless every rank agreed on it (:meth:`Comm.agree`). :meth:`Comm.fail`
  posts the first failure to the rendezvous store (first writer wins) and marks this rank failed: from then on it
  issues no collective at all (ours refuse; the process group is destroyed, so raw ``torch.distributed`` calls fail
  too). A peer's next collective therefore cannot complete; its wait, finding itself blocked, looks at the store
  within milliseconds and raises :class:`PeerFailure` naming the failing rank and its error. No rank can go on
  issuing collectives that pair with a peer's different ones (the silent wrong state of a caught exception).
  Destroying the group also closes the transport when nothing else holds it (then peers fail even sooner, and on
  NCCL, where waits do not poll, that is the mechanism); it is not relied on for gloo, since a third-party reference
  to the group (Hugging Face models hold one) keeps gloo's sockets open.
* At world size 1 without a process group the collectives are local copies, still recorded.

Every collective, its ledger entry and its failure check stay together here (one wrapper, in one place). Beside it:
:mod:`hybridzero.comm.failures` (``PeerFailure``, the shared ``FailureState``) and
:mod:`hybridzero.comm.process_group` (``init_distributed``, ``abort_process_group``); both are re-exported here, so
``from hybridzero.comm.collectives import PeerFailure, init_distributed, DEFAULT_TIMEOUT_S`` keeps working.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hybridzero.comm.failures import FAILURE_KEY, FIRST_CHECK_S, POLL_CHECK_S, FailureState, PeerFailure, describe
from hybridzero.comm.ledger import Ledger
from hybridzero.comm.process_group import DEFAULT_TIMEOUT_S, abort_process_group, init_distributed, world_info

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Comm",
    "FailureState",
    "PeerFailure",
    "PendingCollective",
    "abort_process_group",
    "init_distributed",
]


class PendingCollective:
    """Handle of one issued collective. ``wait()`` completes it; calling it again is a no-op."""

    def __init__(
        self, comm: Comm, work: Any | None, on_done: Callable[[], None] | None = None, label: str = "collective"
    ) -> None:
        self._comm = comm
        self._label = label  # the ledger name: a blocked wait is timed as ``wait.<label>``
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
            work, self._work = self._work, None  # a held Work keeps the transport (gloo's sockets) alive
            with self._comm.ledger.timer.region(f"wait.{self._label}"):
                self._comm._wait(work)
        if self._on_done is not None:
            self._on_done()
        self._done = True


class Comm:
    """Collectives over one process group (``None`` = the default group), recorded in ``ledger`` under ``name``."""

    def __init__(self, ledger: Ledger, group: Any | None = None, name: str = "world") -> None:
        self.ledger = ledger
        self.group = group
        self.name = name
        self.rank, self.world_size = world_info(group)
        self._local = not (dist.is_available() and dist.is_initialized())
        self._poll = not self._local and dist.get_backend(group) == "gloo"
        self.failure_key = FAILURE_KEY  # scoped per engine by ``scope_failures`` so old failures never leak
        self.failures = FailureState()
        self.poll_interval_s = POLL_CHECK_S  # longest pause between two looks at the store while blocked
        # Held so the posted failure stays readable after a teardown: rank 0's store also serves every peer.
        self._store = None if self._local else dist.distributed_c10d._get_default_store()
        self._own_rank = 0 if self._local else dist.get_rank()

    # --- sub-groups --------------------------------------------------------------------------------------------
    def split(self, rank_lists: list[list[int]], name: str) -> Comm:
        """A Comm over the sub-group of ``rank_lists`` that contains this rank (every rank must call this)."""
        if self._local:
            return self._child(None, name)
        self._check_usable()
        mine = None
        for ranks in rank_lists:
            pg = dist.new_group(ranks=ranks)
            if dist.get_rank() in ranks:
                mine = pg
        return self._child(mine, name)

    def _child(self, group: Any | None, name: str) -> Comm:
        child = Comm(self.ledger, group, name)
        child.failure_key, child.failures, child.poll_interval_s = self.failure_key, self.failures, self.poll_interval_s
        return child

    # --- tensor collectives -------------------------------------------------------------------------------------
    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, *, phase: str, async_op: bool = False, label: str = "all_gather"
    ) -> PendingCollective:
        """Gather equal shards ``inp`` of every rank into ``out`` (rank-major, ``out.numel() == W * inp.numel()``).
        ``label`` names the use in the ledger when it is not a parameter gather (e.g. "grad_all_gather")."""
        w = self.world_size
        nbytes = out.numel() * out.element_size()
        self.ledger.record(label, self.name, phase, nbytes, nbytes * (w - 1) // w)
        with self.ledger.timer.region(f"comm.{label}"):
            if w == 1:
                out.copy_(inp.view_as(out))
                return PendingCollective(self, None)
            self._check_usable()
            work = dist.all_gather_single(out, inp, group=self.group, async_op=True)
            return self._finish(work, async_op, label)

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, *, phase: str, async_op: bool = False
    ) -> PendingCollective:
        """Sum ``inp`` (rank-major, ``W * out.numel()``) over ranks; this rank receives its slice in ``out``."""
        w = self.world_size
        nbytes = inp.numel() * inp.element_size()
        self.ledger.record("reduce_scatter", self.name, phase, nbytes, nbytes * (w - 1) // w)
        with self.ledger.timer.region("comm.reduce_scatter"):
            if w == 1:
                out.copy_(inp.view_as(out))
                return PendingCollective(self, None)
            self._check_usable()
            work = dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            return self._finish(work, async_op, "reduce_scatter")

    def exchange_for_reduce(
        self, recv: torch.Tensor, inp: torch.Tensor, *, phase: str, async_op: bool = False
    ) -> PendingCollective:
        """The communication half of an order-deterministic reduce-scatter.

        ``inp`` is rank-major ``[W * S]``; afterwards ``recv`` (``[W * S]``) holds, in rank order, the ``W`` slices
        that every rank sent for this rank's part. The caller sums them in rank order, so the result is bitwise
        independent of the transport's reduction algorithm. Moves exactly the bytes of a reduce-scatter and is
        recorded as one.
        """
        w = self.world_size
        nbytes = inp.numel() * inp.element_size()
        self.ledger.record("reduce_scatter", self.name, phase, nbytes, nbytes * (w - 1) // w)
        with self.ledger.timer.region("comm.reduce_scatter"):
            if w == 1:
                if recv is not inp:
                    recv.copy_(inp)
                return PendingCollective(self, None)
            self._check_usable()
            work = dist.all_to_all_single(recv, inp, group=self.group, async_op=True)
            return self._finish(work, async_op, "reduce_scatter")

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, *, phase: str, label: str = "all_to_all"
    ) -> PendingCollective:
        """Exchange equal chunks: ``inp`` and ``out`` are rank-major ``[W * C]`` (first dimension split in ``W``);
        afterwards chunk ``i`` of ``out`` is chunk ``self.rank`` of rank ``i``'s ``inp`` (exact: values are moved,
        never combined). Synchronous; ``label`` names the use in the ledger (e.g. "sp_all_to_all")."""
        if not (out.is_contiguous() and inp.is_contiguous()):
            raise ValueError("all_to_all needs contiguous buffers (the chunks are read and written rank-major)")
        w = self.world_size
        nbytes = inp.numel() * inp.element_size()
        self.ledger.record(label, self.name, phase, nbytes, nbytes * (w - 1) // w)
        with self.ledger.timer.region(f"comm.{label}"):
            if w == 1:
                if out is not inp:
                    out.copy_(inp)
                return PendingCollective(self, None)
            self._check_usable()
            work = dist.all_to_all_single(out, inp, group=self.group, async_op=True)
            return self._finish(work, False, label)

    def all_reduce(self, t: torch.Tensor, *, phase: str, op: str = "sum", async_op: bool = False) -> PendingCollective:
        """In-place all-reduce of ``t`` with ``op`` in {"sum", "max", "min"}."""
        w = self.world_size
        nbytes = t.numel() * t.element_size()
        self.ledger.record("all_reduce", self.name, phase, nbytes, 2 * nbytes * (w - 1) // w)
        if w == 1:
            return PendingCollective(self, None)
        with self.ledger.timer.region("comm.all_reduce"):
            self._check_usable()
            red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
            work = dist.all_reduce(t, op=red, group=self.group, async_op=True)
            return self._finish(work, async_op, "all_reduce")

    def broadcast(self, t: torch.Tensor, src: int, *, phase: str) -> None:
        """Broadcast ``t`` from group rank ``src`` in place."""
        w = self.world_size
        nbytes = t.numel() * t.element_size()
        self.ledger.record("broadcast", self.name, phase, nbytes, nbytes if self.rank == src and w > 1 else 0)
        if w == 1:
            return
        with self.ledger.timer.region("comm.broadcast"):
            self._check_usable()
            global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
            self._finish(dist.broadcast(t, global_src, group=self.group, async_op=True), False, "broadcast")

    # --- object collectives (metadata, agreement) --------------------------------------------------------------
    def all_gather_object(self, obj: Any, *, phase: str) -> list[Any]:
        """Every rank's ``obj``, in rank order (pickled between our own ranks; metadata and error agreement only).
        Two tensor all-gathers (sizes, then padded bytes) through :meth:`_wait`, so a rank blocked here learns of a
        peer's failure like in any other collective."""
        self.ledger.record("all_gather_object", self.name, phase, 0, 0)
        if self.world_size == 1:
            return [obj]
        self._check_usable()
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else None
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=device)
        self._finish(
            dist.all_gather_single(sizes, torch.tensor([data.numel()], device=device), group=self.group, async_op=True),
            False,
        )
        longest = int(sizes.max())
        sent = torch.zeros(longest, dtype=torch.uint8, device=device)
        sent[: data.numel()] = data
        got = torch.empty(self.world_size * longest, dtype=torch.uint8, device=device)
        self._finish(dist.all_gather_single(got, sent, group=self.group, async_op=True), False)
        rows = got.view(self.world_size, longest).cpu()
        # Bytes from the peer ranks of this job, never from a file: the same trust as torch.distributed's own
        # all_gather_object (also pickle). Files we read go through safetensors/JSON only.
        return [pickle.loads(rows[r, : int(n)].numpy().tobytes()) for r, n in enumerate(sizes.tolist())]

    def barrier(self, *, phase: str) -> None:
        """Wait until every rank of the group arrives."""
        self.ledger.record("barrier", self.name, phase, 0, 0)
        if self.world_size > 1:
            self._check_usable()
            self._finish(dist.barrier(group=self.group, async_op=True), False)

    # --- agreement and failure --------------------------------------------------------------------------------
    def agree(self, error: BaseException | None, what: str, *, phase: str) -> None:
        """Raise on every rank if any rank has ``error`` (one ``all_gather_object``): a failing rank re-raises its own
        error, the others the first failing rank's, with a note naming it. Every rank raises at the same point of
        the collective sequence, so the raised exception is recorded as *agreed* and :meth:`fail` leaves the process
        group up: use this for errors a caller may catch and carry on from (bad input, a checkpoint that fails to
        verify)."""
        errors = self.all_gather_object(error, phase=phase)
        raised = error
        for rank, err in enumerate(errors):
            if raised is None and err is not None:
                if hasattr(err, "add_note"):
                    err.add_note(f"(raised on rank {rank} during {what}; this is rank {self.rank})")
                raised = err
        if raised is not None:
            self.failures.agreed = raised
            raise raised

    def fail(self, exc: BaseException) -> None:
        """``exc`` escaped a call that issues collectives on this rank: unless it was agreed (:meth:`agree`), post it
        (first failure wins), mark this rank failed and tear the process group down, so every peer's pending and next
        collective raises :class:`PeerFailure`. When a peer had already failed, ``exc`` (kept as it is: it may be a
        genuine error of this rank's own) gets a note naming that first failure. Idempotent; never raises; a no-op
        without peers."""
        if self._local or world_info(None)[1] == 1 or self.failures.is_agreed(exc):
            return
        posted = self.peer_failure()
        peer = posted if posted is not None and not posted.startswith(f"rank {self._global_rank()}:") else None
        if peer is None and not isinstance(exc, PeerFailure):
            self.post_failure(describe(exc))
        if self.failures.failed is None:
            self.failures.failed = peer or f"rank {self._global_rank()}: {describe(exc)}"
            if peer is not None and not isinstance(exc, PeerFailure) and hasattr(exc, "add_note"):
                exc.add_note(f"(a peer failed first: {peer})")
        abort_process_group()

    def _global_rank(self) -> int:
        return 0 if self._local else self._own_rank

    def _check_usable(self) -> None:
        """Refuse to issue a collective once this rank failed: it could pair with a peer's different one. Before the
        first collective after an owed one was registered (``failures.owed``), issue that one (it may raise)."""
        owed, self.failures.owed = self.failures.owed, None
        if owed is not None and self.failures.failed is None:
            owed()
        if self.failures.failed is not None:
            raise PeerFailure(
                f"collective on group '{self.name}' refused: the process group was torn down after "
                f"{self.failures.failed}"
            )
        if not dist.is_initialized():
            raise PeerFailure(
                f"collective on group '{self.name}' refused: the process group was torn down after a "
                "failure (on this rank or a peer)"
            )

    def scope_failures(self, scope: str) -> None:
        """Use a failure key of this engine's own (every rank passes the same ``scope``)."""
        self.failure_key = f"{FAILURE_KEY}/{scope}"

    def post_failure(self, message: str) -> None:
        """Tell every peer that this rank failed with ``message`` (best effort; never raises). The first failure
        posted under a key stays (compare-and-set): later ones are consequences of it."""
        if self._store is None:
            return
        value = f"rank {self._global_rank()}: {message}"
        for key in dict.fromkeys((self.failure_key, FAILURE_KEY)):  # this engine's key, and the group-wide one
            try:
                self._store.compare_set(key, "", value)
            except Exception:  # noqa: BLE001 - reporting a failure must never mask it
                pass

    def peer_failure(self) -> str | None:
        """The failure posted for this engine, else for any engine on this process group (``None`` if none)."""
        if self._store is None:
            return None
        for key in dict.fromkeys((self.failure_key, FAILURE_KEY)):
            try:
                if self._store.check([key]):
                    return self._store.get(key).decode()
            except Exception:  # noqa: BLE001 - the store may be gone with the failed rank
                return None
        return None

    @property
    def store(self) -> Any:
        """The rendezvous key-value store every rank shares (``None`` without peers): for reports that must not
        wait on a collective (a failure while peers are blocked in a third party's collectives)."""
        return self._store

    @property
    def polls(self) -> bool:
        """True when waits poll for posted peer failures (gloo)."""
        return self._poll

    def _finish(self, work: Any, async_op: bool, label: str = "collective") -> PendingCollective:
        handle = PendingCollective(self, work, label=label)
        if not async_op:
            handle.wait()
        return handle

    def _wait(self, work: Any) -> None:
        """Complete ``work``; a transport error becomes :class:`PeerFailure` naming the posted failure.

        On gloo (CPU) a wait that blocks polls the store for a posted failure: first after ``FIRST_CHECK_S`` of
        blocking, then at doubling intervals up to ``poll_interval_s``. A failed rank never issues another
        collective (:meth:`_check_usable`), so a peer's collective that needs it blocks and this poll reports it
        within milliseconds. A collective that completes without blocking costs one ``is_completed`` query and no
        store access. NCCL waits stay asynchronous with respect to the host (there the teardown breaks them)."""
        if self._poll and not work.is_completed():
            interval = FIRST_CHECK_S
            next_check = time.monotonic() + interval
            pause = 1e-5
            while not work.is_completed():
                time.sleep(pause)
                pause = min(pause * 2, 5e-4)
                if time.monotonic() >= next_check:
                    posted = self.peer_failure()
                    if posted is not None:
                        raise PeerFailure(f"collective on group '{self.name}' aborted because {posted}")
                    interval = min(interval * 2, self.poll_interval_s)
                    next_check = time.monotonic() + interval
        try:
            work.wait()
        except RuntimeError as exc:
            self._raise_peer_failure(exc)

    def _raise_peer_failure(self, exc: BaseException) -> None:
        posted = self.peer_failure()
        if posted is not None:
            raise PeerFailure(f"collective on group '{self.name}' aborted because {posted}") from exc
        raise PeerFailure(f"collective on group '{self.name}' failed: {exc}") from exc
