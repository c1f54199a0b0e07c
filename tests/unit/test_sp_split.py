"""The split of a rollout's samples over an SP group and the gather back (``hybridzero/rlhf/rollout/sp_split.py``):
pure bounds at s = 1..4 with uneven and empty shares, and :func:`gather_rollout` on every rank of a simulated group
(an all-gather stand-in that serves each rank what the real collective would: every rank's send, rank-major) must
give back the whole rollout, bitwise and in sample order, from each rank's share. The real collective over gloo, and
its ledger entry on the SP group, are tests/distributed/test_sp_split_rollouts.py's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridzero.rlhf.rollout.generate import Rollout
from hybridzero.rlhf.rollout.sp_split import ROWS_LABEL, gather_rollout, generated_rows, join_shares, share_bounds

CASES = [(n, s) for s in range(1, 5) for n in range(1, 10)]


@pytest.mark.parametrize(("n", "s"), CASES)
def test_shares_cover_the_samples_in_order(n: int, s: int) -> None:
    bounds = share_bounds(n, s)
    assert len(bounds) == s and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, in rank order
    per = -(-n // s)
    assert all(hi - lo == per for lo, hi in bounds if hi < n) and all(hi - lo <= per for lo, hi in bounds)
    for r in range(s):
        lo, hi = bounds[r]
        assert generated_rows(n, s, r) == (list(range(lo, hi)) or [0])  # an empty share: a placeholder row


def test_uneven_and_empty_shares() -> None:
    assert share_bounds(5, 2) == [(0, 3), (3, 5)]
    assert share_bounds(5, 4) == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert share_bounds(1, 4) == [(0, 1), (1, 1), (1, 1), (1, 1)]
    assert share_bounds(0, 3) == [(0, 0)] * 3
    with pytest.raises(ValueError, match="n = 0"):
        generated_rows(0, 2, 0)
    with pytest.raises(ValueError, match="size = 0"):
        share_bounds(3, 0)


def test_join_shares_drops_each_shares_padding() -> None:
    bounds = share_bounds(5, 4)  # per = 2: ranks hold 2, 2, 1, 0 real rows
    gathered = torch.tensor([0, 1, 2, 3, 4, -1, -1, -1])
    assert join_shares(gathered, bounds).tolist() == [0, 1, 2, 3, 4]


class _TwoPassComm:
    """A stand-in for one rank's SP ``Comm``: in the first pass it records what this rank sends; in the second it
    fills ``out`` with every rank's recorded send of the same call, rank-major (what ``all_gather`` returns)."""

    def __init__(self, size: int, rank: int, sends: dict[tuple[int, int], torch.Tensor], serve: bool) -> None:
        self.world_size, self.rank, self.sends, self.serve = size, rank, sends, serve
        self.calls: list[tuple[str, str]] = []

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, phase: str, label: str = "all_gather") -> None:
        call = len(self.calls)
        self.calls.append((label, phase))
        if self.serve:
            out.copy_(torch.cat([self.sends[(call, k)] for k in range(self.world_size)]).view_as(out))
        else:
            self.sends[(call, self.rank)] = inp.clone()
            out.zero_()


def _rollout(n: int, width: int = 7) -> tuple[Rollout, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    seq = torch.randint(0, 1000, (n, width), generator=gen)
    mask = torch.randint(0, 2, (n, width), generator=gen)
    ro = Rollout(seq, mask, mask[:, 1:].clone(), 3, torch.rand(n, generator=gen) > 0.5)
    return ro, torch.randn(n, width - 1, generator=gen)


def _rows(ro: Rollout, sampler: torch.Tensor, rows: list[int]) -> tuple[Rollout, torch.Tensor]:
    assert ro.finished is not None
    idx = torch.tensor(rows)
    share = Rollout(ro.sequences[idx], ro.attention_mask[idx], ro.action_mask[idx], ro.prompt_width, ro.finished[idx])
    return share, sampler[idx]


@pytest.mark.parametrize(("n", "s"), CASES)
def test_gather_rollout_gives_every_rank_the_whole_rollout(n: int, s: int) -> None:
    whole, sampler = _rollout(n)
    sends: dict[tuple[int, int], torch.Tensor] = {}
    shares = [_rows(whole, sampler, generated_rows(n, s, r)) for r in range(s)]
    for r in range(s):  # pass 1: every rank's sends
        first: Any = _TwoPassComm(s, r, sends, serve=False)
        gather_rollout(first, *shares[r], n)
    for r in range(s):  # pass 2: what each rank gets back
        comm: Any = _TwoPassComm(s, r, sends, serve=True)
        got, got_sampler = gather_rollout(comm, *shares[r], n)
        for name in ("sequences", "attention_mask", "action_mask", "finished"):
            want, have = getattr(whole, name), getattr(got, name)
            assert have.dtype == want.dtype and torch.equal(have, want), (n, s, r, name)
        assert got_sampler is not None and torch.equal(got_sampler, sampler), (n, s, r)
        assert got.prompt_width == whole.prompt_width
        assert comm.calls == [(ROWS_LABEL, "rollout")] * 5  # sequences, two masks, finished, sampler


def test_gather_rollout_without_sampler_or_flags() -> None:
    full, _ = _rollout(3)
    whole = Rollout(full.sequences, full.attention_mask, full.action_mask, 3, None)
    sends: dict[tuple[int, int], torch.Tensor] = {}
    for serve in (False, True):
        for r in range(2):
            idx = torch.tensor(generated_rows(3, 2, r))
            share = Rollout(whole.sequences[idx], whole.attention_mask[idx], whole.action_mask[idx], 3, None)
            comm: Any = _TwoPassComm(2, r, sends, serve)
            got, got_sampler = gather_rollout(comm, share, None, 3)
            assert got_sampler is None and got.finished is None and len(comm.calls) == 3
            assert not serve or torch.equal(got.sequences, whole.sequences)
