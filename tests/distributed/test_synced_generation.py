"""A rank that leaves ZeRO-3 synced generation (bare ``engine.module.generate``) with an exception between two
forwards does not strand its peers in Hugging Face's flag all-reduce: at the failing rank's next collective every
rank raises ``GenerationDesync`` together, the process group stays usable, and the next generation gives the same
tokens as before. See :mod:`hybridzero.runtime.synced_generation`."""

from __future__ import annotations

import pytest

from hybridzero.runtime.synced_generation import decode, guard_fits, values
from tests.workers.synced_generation import abandon_synced_generation


def test_exchange_classes_decode_exactly() -> None:
    """Every mixture of roles at every world the guard runs at decodes to its counts (float32-exact sums)."""
    import torch

    assert guard_fits(2) and guard_fits(63) and not guard_fits(64) and not guard_fits(1)
    for world in (2, 3, 4, 63):
        v = values(world)
        for sync, close, resolve in [(world, 0, 0), (0, world, 0), (1, 0, 0), (0, 1, world - 1), (world - 1, 1, 0)]:
            flagged = world - sync - close - resolve
            for ones in {0, flagged}:
                total = sync * v["sync"] + close * v["close"] + resolve * v["resolve"] + ones
                as_f32 = float(torch.tensor(total, dtype=torch.float32))
                assert decode(as_f32, world) == {"sync": sync, "close": close, "resolve": resolve, "flagged": flagged}


@pytest.mark.parametrize(
    ("size", "failing", "next_call"), [(2, [1], "forward"), (2, [1], "retry"), (3, [0, 2], "retry")]
)
def test_rank_leaving_synced_generation_does_not_strand_peers(world, size: int, failing: list[int], next_call: str):
    pool = world(size)
    seen = pool.run(abandon_synced_generation, failing, next_call, timeout=180)
    for rank, res in enumerate(seen):
        assert res["syncs_per_generate"] == 6, res  # one exchange per forward (6 new tokens), the close still owed
        if rank in failing:
            assert "injected failure" in res["generate"], res
            assert res["next"].startswith("GenerationDesync"), res
        else:
            assert res["generate"].startswith("GenerationDesync"), res
        assert res["failed"] is None and res["recovered"] and res["logits_equal"], res
    assert not pool.broken
