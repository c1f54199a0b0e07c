"""What a process knows about failures on a process group: the error a peer's collective raises, the sticky state a
:class:`~hybridzero.comm.collectives.Comm` and its splits share, and the constants of the rendezvous-store poll.

Pure bookkeeping (no collective, no ``torch.distributed``): the protocol itself -- posting the first failure to the
store, refusing collectives once failed, a blocked wait polling the store -- lives with the collectives it guards in
:mod:`hybridzero.comm.collectives`.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

FAILURE_KEY = "hybridzero/failure"  # the group-wide store key; an engine's own key is ``FAILURE_KEY/<scope>``
FIRST_CHECK_S = 1e-3  # a blocked wait first looks for a posted failure after this long
POLL_CHECK_S = 0.05  # ... and then at least this often


class PeerFailure(RuntimeError):
    """A collective could not complete because another rank failed (its rank and error are in the message)."""


class FailureState:
    """What this process knows about failures on one process group; shared by a :class:`Comm` and its splits.

    ``failed`` is set once (sticky) when this rank tore the group down; ``agreed`` is the last exception that every
    rank raised together after :meth:`Comm.agree` (not fatal: the ranks are still in step). ``owed`` is a collective
    this rank owes its peers before any other on the group (the close of a ZeRO-3 synced generation, see
    :mod:`hybridzero.runtime.synced_generation`): :meth:`Comm._check_usable` runs it once, first."""

    def __init__(self) -> None:
        self.failed: str | None = None
        self.agreed: BaseException | None = None
        self.owed: Callable[[], None] | None = None

    def is_agreed(self, exc: BaseException) -> bool:
        """True when ``exc``, or an exception it was raised from (16 links at most), is the agreed one."""
        agreed, seen = self.agreed, 0
        link: BaseException | None = exc
        while agreed is not None and link is not None and seen < 16:
            if link is agreed:
                return True
            link, seen = link.__cause__ or link.__context__, seen + 1
        return False


def describe(exc: BaseException) -> str:
    """``exc`` as one line: its type and message (what is posted to the store)."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
