"""Models laid out unlike a Hugging Face decoder, each trained as the single-process reference: blocks in an
``nn.Sequential`` stack (timm's layout; one gather group a block, gathered around the block's forward), and a block
reading another block's weight (``register_external_parameter``)."""

from __future__ import annotations

import pytest
import torch

from tests.workers.layouts import DEPTH, build_stack, sharing_reference, sharing_run, stack_reference, stack_run


@pytest.mark.parametrize("world_size", [2, 3])
def test_sequential_stack_blocks_are_gathered_one_at_a_time(world, world_size: int) -> None:
    """Groups: the root (embedding projection and the mixed head) and one a block; the first forward all-gathers
    each once; with prefetch and the forward-to-backward reuse off, at most the root and one block (and its
    padding) are whole at a time, well below the whole model's bytes;
    losses and final parameters equal the reference's within fp32 rounding of the gradient average (every
    quantity is O(1), three Adam steps of lr 1e-2: 1e-5 relative, 1e-6 absolute leaves orders of magnitude)."""
    got = world(world_size).run(stack_run)
    ref = stack_reference(world_size)
    sizes = {n: p.numel() for n, p in build_stack().named_parameters()}
    block = sum(v for n, v in sizes.items() if n.startswith("blocks.0."))
    root = sum(v for n, v in sizes.items() if not n.startswith("blocks."))
    for rank, r in enumerate(got):
        assert r["groups"] == ["root"] + [f"blocks.{i}" for i in range(DEPTH)]
        assert r["forward_gathers"] == 1 + DEPTH
        assert 4 * (root + block) <= r["peak"] < 4 * (root + 2 * block) < 4 * sum(sizes.values())
        for step, loss in enumerate(r["losses"]):
            assert loss == pytest.approx(ref["losses"][step][rank], rel=1e-5, abs=1e-6)
    for name, value in ref["params"].items():
        torch.testing.assert_close(got[0]["params"][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 3])
def test_registered_external_parameter_is_whole_where_it_is_read(world, world_size: int) -> None:
    """``deepspeed.zero.register_external_parameter(block1, block0.fc.weight)`` in ``__init__``: that weight joins
    the root group (whole for the whole forward), so block 1's forward reads its full value; the run equals the
    reference (tolerance as above). After ``initialize``, registering a root parameter again is a no-op and
    registering a block's parameter is refused naming it."""
    got = world(world_size).run(sharing_run)
    ref = sharing_reference(world_size)
    for rank, r in enumerate(got):
        assert r["groups"]["root"] == ["layers.0.fc.weight", "head.weight", "head.bias"]
        assert r["groups"]["layers.0"] == ["layers.0.fc.bias"]
        assert "'layers.1.fc.weight'" in r["late"] and "before initialize" in r["late"]
        for step, loss in enumerate(r["losses"]):
            assert loss == pytest.approx(ref["losses"][step][rank], rel=1e-5, abs=1e-6)
    for name, value in ref["params"].items():
        torch.testing.assert_close(got[0]["params"][name], value, rtol=1e-5, atol=1e-6)
