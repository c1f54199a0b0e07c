"""DeepSpeed's reduction options act: ``gradient_allreduce_op`` (sum / mean; sum ignores the two scalings, as in
DeepSpeed), ``prescale_gradients``,
``gradient_predivide_factor`` against a single-process reference; ``ignore_unused_parameters: false``; and
``steps_per_print``.

Reference: the per-rank gradients of ``batches[0, 0, r]`` computed here, unsharded, summed in rank order in fp32
(``S``); ``mean`` is ``S / W``. Tolerance for the scaled variants (derived, not tuned): with unit roundoff
``u = 2**-24`` each contribution divided by ``f`` (or ``W``) is off by at most ``u`` relative, the rank-ordered sum
of ``W`` terms adds at most ``(W - 1) u`` times the sum of magnitudes, the division after the sum ``u`` more; the
plain mean carries ``W u`` of its own. So elementwise
``|variant - mean| <= (2 W + 2) u * sum_r |g_r| / W`` (doubled here for the few fp32 ulps of the absolute terms).
The SGD update ``p - lr g`` inherits ``lr`` times that, plus one rounding of the subtraction (``u |p|``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness.parity import RunSpec, batches_for, build_model
from tests.workers.reduction import progress_run, reduction_run, unused_parameter_run

U = 2.0**-24
LR = 0.1


def _reference(spec: RunSpec, world_size: int) -> tuple[dict[str, list[torch.Tensor]], dict[str, torch.Tensor]]:
    """Per-rank gradients (name -> list over ranks) and the initial parameters, in one process (1 thread, as the
    workers run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(spec)
        batches = batches_for(spec, world_size, int(model.config.vocab_size))
        per_rank: dict[str, list[torch.Tensor]] = {}
        for r in range(world_size):
            model.zero_grad(set_to_none=True)
            ids = batches[0, 0, r]
            model(input_ids=ids, labels=ids).loss.backward()
            for name, p in model.named_parameters():
                per_rank.setdefault(name, []).append(p.grad.clone())
        return per_rank, {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def _ordered_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    total = grads[0].float().clone()
    for g in grads[1:]:
        total.add_(g)
    return total


CASES = {  # name -> (top-level keys, zero keys, stage, persistence threshold)
    "mean_z3": ({}, {}, 3, 200),
    "sum_z3": ({"gradient_allreduce_op": "sum"}, {}, 3, 200),
    "sum_z2": ({"gradient_allreduce_op": "SUM"}, {}, 2, 0),
    "mean_z2": ({}, {}, 2, 0),
    "prescale_z3": ({"prescale_gradients": True}, {}, 3, 200),
    "predivide3_z3": ({"gradient_predivide_factor": 3.0}, {}, 3, 200),
    "predivide3_z1": ({"gradient_predivide_factor": 3.0}, {}, 1, 0),
    "qgz_mean": ({}, {"zero_quantized_gradients": True}, 3, 0),
    "qgz_sum": ({"gradient_allreduce_op": "sum"}, {"zero_quantized_gradients": True}, 3, 0),
}
# DeepSpeed's ``sum`` ignores prescale and predivide (it divides only when averaging): each is the plain sum
SUM_SCALED = {
    "sum_predivide2_z0": ({"gradient_allreduce_op": "sum", "gradient_predivide_factor": 2.0}, {}, 0, 0),
    "sum_prescale_z1": ({"gradient_allreduce_op": "sum", "prescale_gradients": True}, {}, 1, 0),
    "sum_predivide2_z2": ({"gradient_allreduce_op": "sum", "gradient_predivide_factor": 2.0}, {}, 2, 0),
    "sum_both_z3": (
        {"gradient_allreduce_op": "sum", "prescale_gradients": True, "gradient_predivide_factor": 2.0},
        {},
        3,
        200,
    ),
}


def _run_all(pool: Any, cases: dict[str, tuple[dict[str, Any], dict[str, Any], int, int]]) -> dict[str, Any]:
    out = {}
    for name, (top, zero, stage, persist) in cases.items():
        spec = RunSpec(model="llama", stage=stage, persistence_threshold=persist, steps=1)
        out[name] = pool.run(reduction_run, spec, top, zero, LR)[0]
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [2, 4])
def test_allreduce_op_prescale_and_predivide_against_reference(world, world_size: int) -> None:
    runs = _run_all(world(world_size), {**CASES, **SUM_SCALED})
    per_rank, initial = _reference(RunSpec(model="llama", steps=1), world_size)
    for name, grads in per_rank.items():
        total = _ordered_sum(grads)
        mean = total.clone().div_(world_size)
        # mean: the reference's sum / W, bit for bit (stage 3 with replicated small parameters, and stage 2)
        assert torch.equal(runs["mean_z3"]["grads"][name], mean), name
        assert torch.equal(runs["mean_z2"]["grads"][name], mean), name
        # sum: the unscaled rank-ordered sum, exactly W times mean's gradient (W a power of two: exact)
        for case in ("sum_z3", "sum_z2"):
            assert torch.equal(runs[case]["grads"][name], total), (case, name)
            assert torch.equal(runs[case]["grads"][name], runs["mean_z3"]["grads"][name] * world_size), (case, name)
        assert torch.equal(runs["qgz_sum"]["grads"][name], runs["qgz_mean"]["grads"][name] * world_size), name
        for case in SUM_SCALED:  # the gradient and the step (same SGD on the same gradient) are sum's, bit for bit
            assert torch.equal(runs[case]["grads"][name], total), (case, name)
            assert torch.equal(runs[case]["params"][name], runs["sum_z3"]["params"][name]), (case, name)
        bound = 2 * (2 * world_size + 2) * U * _ordered_sum([g.abs() for g in grads]) / world_size
        for case in ("prescale_z3", "predivide3_z3", "predivide3_z1"):
            got = runs[case]["grads"][name]
            assert bool(((got - mean).abs() <= bound).all()), (case, name, (got - mean).abs().max())
            step = runs[case]["params"][name] - runs["mean_z3"]["params"][name]
            assert bool((step.abs() <= LR * bound + 2 * U * initial[name].abs() + 1e-12).all()), (case, name)
        # the update itself: SGD's p - lr g, within the roundings of the product and the subtraction
        expected = initial[name] - LR * mean
        slack = 2 * U * (initial[name].abs() + LR * mean.abs())
        assert bool(((runs["mean_z3"]["params"][name] - expected).abs() <= slack).all()), name
    # predivide changes the rounding (f = 3 is not a power of two): the option did act somewhere
    assert any(not torch.equal(runs["predivide3_z3"]["grads"][n], runs["mean_z3"]["grads"][n]) for n in per_rank)


@pytest.mark.timeout(300)
def test_sum_ignores_prescale_and_predivide_at_world_3(world) -> None:
    """W = 3 (not a power of two): ``sum`` with predivide 2 and/or prescale at stages 0-3 is the rank-ordered sum of
    the single-process per-rank gradients, bit for bit, and the SGD step is ``p - lr * sum`` (within its roundings)."""
    runs = _run_all(world(3), SUM_SCALED)
    per_rank, initial = _reference(RunSpec(model="llama", steps=1), 3)
    for name, grads in per_rank.items():
        total = _ordered_sum(grads)
        expected = initial[name] - LR * total
        slack = 2 * U * (initial[name].abs() + LR * total.abs())
        for case in SUM_SCALED:
            assert torch.equal(runs[case]["grads"][name], total), (case, name)
            assert bool(((runs[case]["params"][name] - expected).abs() <= slack).all()), (case, name)


@pytest.mark.timeout(300)
def test_ignore_unused_parameters_false_raises_at_stages_1_and_2(world) -> None:
    pool = world(2)
    for stage in (1, 2):
        messages = pool.run(unused_parameter_run, stage, False)
        for message in messages:  # every rank raises, naming the parameters, and stays quiescent
            assert message.startswith("UnusedParametersError: ")  # an AssertionError, as DeepSpeed raises
            assert "got no gradient" in message and "model.layers.1.mlp.down_proj.weight" in message
            assert "model.norm.weight" in message and "ignore_unused_parameters" in message
            assert "model.layers.0.mlp.down_proj.weight" not in message
        assert pool.run(unused_parameter_run, stage, True) == ["", ""]  # DeepSpeed's default: ignored
    assert pool.run(unused_parameter_run, 3, False) == ["", ""]  # stage 3: DeepSpeed does not check (warned at load)


@pytest.mark.timeout(300)
def test_steps_per_print_logs_progress_every_n_steps_on_rank_0(world) -> None:
    lines = world(2).run(progress_run, 2, 5)
    assert [line.split(",")[0] for line in lines[0]] == ["step=2", "step=4"]  # DeepSpeed's _report_progress
    assert "skipped=0" in lines[0][0] and "lr=[" in lines[0][0]
    assert lines[1] == []  # rank 0 only
