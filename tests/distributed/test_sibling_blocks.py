"""Blocks registered one by one (``self.first = Block()``, ...; no ``ModuleList``) are gathered one at a time, as
DeepSpeed fetches each submodule, and DeepSpeed's optimizer-wrapper names act on them as its partitioning tests
expect (issue 31): checked at worlds 2-4 against a single-process reference of the same weights and data."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.workers.sibling_blocks import NAMES, SHAPE, run

pytestmark = pytest.mark.timeout(300)

LR = 0.1
TOL = {"rtol": 1e-6, "atol": 1e-7}  # the averaged gradient is (g + ... + g) / W in fp32: within an ulp of g


def _whole(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Each weight as the ranks wrote it: rank r's part (``ds_tensor``'s size there) filled with (i + 1)(r + 1),
    the parts in rank order tiling the parameter."""
    out = {}
    for i, name in enumerate(NAMES):
        parts = [torch.full((r["sizes"][i],), float((i + 1) * (r["rank"] + 1))) for r in results]
        out[name] = torch.cat(parts).reshape(SHAPE)
    return out


def _reference(weights: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Loss, gradients and the weights after one Adam step, in one process."""
    params = {n: torch.nn.Parameter(w.clone()) for n, w in weights.items()}
    x = torch.linspace(-1.0, 1.0, SHAPE[0] * SHAPE[1]).reshape(SHAPE)
    for n in NAMES:
        x = params[n] * x
    loss = (x - 1).abs().sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in params.items()}  # type: ignore[union-attr]
    opt = torch.optim.Adam(params.values(), lr=LR)
    opt.step()
    return loss.detach(), grads, torch.stack([p.detach() for p in params.values()])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sibling_blocks_fetch_alone_and_answer_deepspeed_names(world, world_size: int) -> None:
    results = world(world_size).run(run, LR)
    weights = _whole(results)
    loss, grads, stepped = _reference(weights)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
    for r in results:
        for log in r["logs"]:
            for when, block, status in log:  # each block whole exactly while its own forward runs
                assert status == ("AVAILABLE" if when == "inside" else "NOT_AVAILABLE"), (r["rank"], when, block)
        assert r["groups"] == [0]  # one optimizer param group: one DeepSpeed sub-group, however many blocks
        assert r["losses"] == [float(loss)] * 2, (r["losses"], float(loss))
        assert r["zeroed"], "optimizer.zero_grad() zeroes the reduced gradient parts"
        assert r["global_steps"] == 0, "optimizer.step() is the ZeRO step only: counters are engine.step()'s"
        assert r["norm"] == pytest.approx(float(norm), rel=1e-6)
        torch.testing.assert_close(torch.stack([r["full"][n] for n in NAMES]), stepped, **TOL)
    for name in NAMES:  # two backward calls without a step accumulate; the parts in rank order, then zero padding
        cat = torch.cat([r["twice"][name] for r in results])
        numel = SHAPE[0] * SHAPE[1]
        assert cat.numel() >= numel and not cat[numel:].any(), name
        torch.testing.assert_close(cat[:numel], 2 * grads[name].reshape(-1), **TOL)


def test_sibling_blocks_with_a_prefetch_bucket_holding_the_model(world) -> None:
    """DeepSpeed's prefetch rule (its test_prefetching): once the trace is known, the root forward starts gathering
    the first block before any block runs, and a block stays gathered after its forward (the bucket would fetch it
    again for the backward); the first forward, with no trace, fetches each block alone. Values are unchanged."""
    results = world(2).run(run, LR, True)
    loss, _, stepped = _reference(_whole(results))
    for r in results:
        first, second = r["logs"]
        assert all(s == ("AVAILABLE" if w == "inside" else "NOT_AVAILABLE") for w, _, s in first), first
        status = {(w, b): s for w, b, s in second}
        before = ["start"] + [f"after {n}" for n in NAMES[:-1]]  # the moment before each block is called
        assert all(status[(w, b)] in ("INFLIGHT", "AVAILABLE") for w, b in zip(before, NAMES)), second
        assert all(status[(f"after {b}", b)] == "AVAILABLE" for b in NAMES), second
        assert r["losses"] == [float(loss)] * 2
        torch.testing.assert_close(torch.stack([r["full"][n] for n in NAMES]), stepped, **TOL)
