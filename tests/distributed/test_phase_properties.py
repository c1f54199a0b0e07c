"""Property: any sequence of engine phases ends quiescent after every phase, and prefetch (off vs large) never
changes a single bit of any output or parameter."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.workers.phases import LARGE_BUCKET, PHASE_KINDS, Phase, phase_sequence_pair

_WORLD_SIZE = 2
_TIMEOUT_S = 120.0


def _phase_of(kind: str) -> st.SearchStrategy[Phase]:
    """A phase of ``kind`` with its argument: new tokens for ``generate``, ``use_reentrant`` for ``ckpt``."""
    if kind == "generate":
        return st.tuples(st.just(kind), st.integers(min_value=1, max_value=4))
    if kind == "ckpt":
        return st.tuples(st.just(kind), st.integers(min_value=0, max_value=1))
    return st.just((kind, 0))


_PHASE: st.SearchStrategy[Phase] = st.sampled_from(PHASE_KINDS).flatmap(_phase_of)


def _check_pair(phases: list[Phase], results: list[dict[int, dict[str, Any]]]) -> None:
    """Prefetch off really prefetched nothing; every output on every rank and every parameter bitwise equal."""
    for rank, by_bucket in enumerate(results):
        off, large = by_bucket[0], by_bucket[LARGE_BUCKET]
        assert off["prefetches"] == 0
        for i, (a, b) in enumerate(zip(off["outputs"], large["outputs"], strict=True)):
            assert torch.equal(a, b), f"rank {rank}: output of phase {i} {phases[i]} differs with prefetch"
    off_params, large_params = results[0][0]["params"], results[0][LARGE_BUCKET]["params"]
    assert off_params.keys() == large_params.keys()
    for name, value in off_params.items():
        assert torch.equal(value, large_params[name]), f"{name} differs with prefetch after {phases}"


@settings(max_examples=15, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(phases=st.lists(_PHASE, min_size=3, max_size=8))
@example(
    phases=[
        ("train", 0),
        ("generate", 3),
        ("twice", 0),
        ("submodule", 0),
        ("ckpt", 1),
        ("eval", 0),
        ("ckpt", 0),
        ("nograd", 0),
    ]
)  # every kind at least once, whatever hypothesis draws
def test_random_phase_sequences_quiescent_and_prefetch_invariant(world: Any, phases: list[Phase]) -> None:
    """For a drawn sequence of 3-8 phases (train step, train-mode no-grad forward, eval forward, generate with 1-4
    new tokens, embedding/project_in/block called directly with a step, block 0 called twice in one forward,
    activation-checkpointed step reentrant or not) each rank runs it on a fresh engine twice, prefetch off and large:
    quiescent after every phase (asserted in the worker), and the two runs' outputs and final parameters are bitwise
    equal."""
    results = world(_WORLD_SIZE).run(phase_sequence_pair, phases, timeout=_TIMEOUT_S)
    _check_pair(phases, results)
