"""A group's flat gradient buffer (``ShardedGroup.accept_grad`` / ``take_grad_full``): one copy per first delivery,
an add for a second, zeros wherever no trainable parameter wrote (alignment gaps, padding, frozen and undelivered
parameters). World 1, no process group: the buffer logic does not depend on the world size."""

from __future__ import annotations

import torch
from torch import nn

from hybridzero.comm.collectives import Comm
from hybridzero.comm.ledger import Ledger
from hybridzero.zero.groups import ShardedGroup


def _group() -> ShardedGroup:
    params = [
        ("a", nn.Parameter(torch.ones(3, 5))),  # 15 elements: a 1-element alignment gap follows
        ("frozen", nn.Parameter(torch.ones(7), requires_grad=False)),
        ("b", nn.Parameter(torch.ones(9))),
        ("c", nn.Parameter(torch.ones(2))),
    ]
    return ShardedGroup(0, "g", "blk", params, Comm(Ledger()), torch.float32, torch.float32, torch.device("cpu"))


def test_buffer_holds_exactly_the_delivered_gradients_and_zeros_elsewhere() -> None:
    group = _group()
    group.grad_full = None
    specs = [slot.spec for slot in group.slots]
    ga, gb, gb2 = torch.full((3, 5), -0.0), torch.arange(9.0), torch.full((9,), 0.5)
    assert not group.accept_grad(0, ga)
    assert not group.accept_grad(2, gb)
    assert not group.accept_grad(2, gb2)  # a second delivery of the same parameter adds
    full = group.take_grad_full()  # "c" never delivered: its range reads as zeros
    assert full is not None and group.grad_full is None
    expected = torch.zeros(group.layout.padded_numel)
    expected[specs[0].offset : specs[0].end] = ga.reshape(-1)
    expected[specs[2].offset : specs[2].end] = gb + gb2
    assert torch.equal(full, expected)
    assert torch.equal(full[specs[0].offset : specs[0].end].signbit(), torch.ones(15, dtype=torch.bool))  # copied


def test_a_reused_buffer_never_leaks_a_previous_backward() -> None:
    group = _group()
    for value in (3.0, 5.0):
        for i, slot in enumerate(group.slots):
            if slot.trainable:
                done = group.accept_grad(i, torch.full(slot.spec.shape, value))
        assert done
        full = group.take_grad_full()
        assert full is not None
        trainable = sum(slot.spec.numel for slot in group.slots if slot.trainable)
        assert float(full.sum()) == value * trainable  # gaps, padding and the frozen range are zero
