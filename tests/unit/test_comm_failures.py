"""Comm's agreement and failure bookkeeping without peers (the distributed behaviour is in
tests/distributed/test_failures.py): agreed errors are recognised through ``raise ... from``, failing is a no-op
alone, and a split Comm shares its parent's failure state."""

from __future__ import annotations

import pytest

from hybridzero.comm.collectives import Comm, PeerFailure
from hybridzero.comm.ledger import Ledger


def test_agree_raises_the_error_and_records_it_as_agreed() -> None:
    comm = Comm(Ledger())
    comm.agree(None, "nothing", phase="init")  # no error anywhere: returns
    error = ValueError("bad tag 'x'")
    with pytest.raises(ValueError, match="bad tag"):
        comm.agree(error, "load", phase="checkpoint")
    assert comm.failures.agreed is error
    try:
        raise RuntimeError("wrapped") from error
    except RuntimeError as wrapped:
        assert comm.failures.is_agreed(wrapped)  # an agreed error re-raised as the cause of another stays agreed
    assert not comm.failures.is_agreed(ValueError("another"))
    assert comm.ledger.total(collective="all_gather_object").calls == 2


def test_fail_without_peers_changes_nothing() -> None:
    comm = Comm(Ledger())
    assert comm.fail(RuntimeError("boom")) is None
    assert comm.failures.failed is None and comm.peer_failure() is None


def test_split_shares_the_failure_state() -> None:
    comm = Comm(Ledger())
    child = comm.split([[0]], name="node")
    assert child.failures is comm.failures and child.ledger is comm.ledger
    comm.failures.failed = "rank 1: IndexError: index out of range"
    with pytest.raises(PeerFailure, match="refused.*rank 1: IndexError"):
        child._check_usable()  # once failed, no Comm of the group issues another collective
