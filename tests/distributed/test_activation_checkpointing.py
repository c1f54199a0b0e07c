"""``deepspeed.checkpointing.checkpoint`` around ZeRO-3 blocks (issue 31, Megatron-style model code): the blocks are
gathered again for the recomputation inside the backward, the dropout masks are replayed from the RNG tracker's
stream, and training is bitwise the run without checkpointing, at worlds 2 and 3."""

from __future__ import annotations

import pytest
import torch

from tests.workers.activation_ckpt import run

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world_size", [2, 3])
def test_checkpointed_blocks_train_as_plain_ones(world, world_size: int) -> None:
    pool = world(world_size)
    plain = pool.run(run, False)
    checkpointed = pool.run(run, True)
    for p, c in zip(plain, checkpointed):
        assert p["losses"] == c["losses"]
        assert len(set(p["losses"])) == 3  # the steps changed something
        for name, t in p["params"].items():
            assert torch.equal(t, c["params"][name]), name
