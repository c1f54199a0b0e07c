"""DeepSpeed's ``"Lion"`` and ``"Adagrad"`` optimizer types and its ``deepspeed.ops.lion`` / ``deepspeed.ops.adagrad``
classes: the Lion update (hybridzero.optim.lion) against its formula, the ZeRO invariant that a step over any
partition of the elements is the step over the whole, the config block, and the classes' DeepSpeed signatures."""

from __future__ import annotations

import pytest
import torch

from hybridzero.config import load_config
from hybridzero.ops.adagrad import DeepSpeedCPUAdagrad
from hybridzero.ops.lion import DeepSpeedCPULion, FusedLion
from hybridzero.optim.factory import build_optimizer, rebuild_optimizer
from hybridzero.optim.lion import Lion, fp32_coefficients, lion_step
from hybridzero.plan.memory import states_per_element


def _one_minus(x: float) -> float:
    """``1 - x`` in fp32 tensor arithmetic (how DeepSpeed's kernels form Lion's coefficients)."""
    return float(torch.tensor(1.0) - torch.tensor(x, dtype=torch.float32))


def _formula(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, lr: float, b1: float, b2: float, wd: float) -> None:
    """The module docstring's update with plain per-tensor ops and fp32 coefficients, in the same order (so equal
    bit for bit)."""
    c = torch.add(m * b1, g, alpha=_one_minus(b1)).sign()
    if wd != 0.0:
        p.mul_(_one_minus(float(torch.tensor(lr) * torch.tensor(wd))))
    p.add_(c, alpha=-lr)
    m.mul_(b2).add_(g, alpha=_one_minus(b2))


def test_coefficients_are_formed_in_fp32() -> None:
    _, keep1, _, keep2, decay, _ = fp32_coefficients(1e-3, 0.9, 0.999, 0.1)
    assert keep2 == float(torch.tensor(1.0) - torch.tensor(0.999)) != 1.0 - 0.999
    assert keep1 == float(torch.tensor(1.0) - torch.tensor(0.9)) and decay == float(1 - torch.tensor(1e-4))


def test_one_step_by_hand() -> None:
    p, m = torch.tensor([1.0, 1.0, -2.0]), torch.zeros(3)
    g = torch.tensor([0.5, -0.5, 0.0])
    lion_step([p], [g], [m], lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.1)
    # c = 0.1 * g: signs +, -, 0 (no move); decay 1 - 0.1 * 0.1 = 0.99 everywhere
    torch.testing.assert_close(p, torch.tensor([0.99 - 0.1, 0.99 + 0.1, -2.0 * 0.99]), rtol=0, atol=1e-7)
    # 1 - 0.99 is formed in fp32 (0.0099999905): within 1e-6 relative of 0.005
    torch.testing.assert_close(m, torch.tensor([0.005, -0.005, 0.0]), rtol=0, atol=1e-8)


def test_zero_interpolation_does_not_move_the_element() -> None:
    p = torch.nn.Parameter(torch.tensor([3.0, -1.0]))
    opt = Lion([p], lr=0.5)
    opt.step()  # no gradient: skipped, no state made
    assert not opt.state
    p.grad = torch.zeros(2)
    opt.step()
    assert torch.equal(p.detach(), torch.tensor([3.0, -1.0]))
    assert set(opt.state[p]) == {"exp_avg"}


def test_steps_equal_the_formula_and_maximize_negates() -> None:
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=gen) for n in (37, 1, 5)]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    flipped = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [t.clone() for t in start]
    moms = [torch.zeros_like(t) for t in start]
    hyper = {"lr": 0.01, "betas": (0.8, 0.95), "weight_decay": 0.1}
    opt = Lion([{"params": params[:2]}, {"params": params[2:], "lr": 0.02}], **hyper)
    other = Lion([{"params": flipped[:2]}, {"params": flipped[2:], "lr": 0.02}], maximize=True, **hyper)
    for _ in range(4):
        grads = [torch.randn(t.shape, generator=gen) for t in start]
        for p, q, g in zip(params, flipped, grads):
            p.grad, q.grad = g.clone(), -g
        opt.step()
        other.step()
        for i, (r, m, g) in enumerate(zip(ref, moms, grads)):
            _formula(r, g, m, 0.02 if i == 2 else 0.01, 0.8, 0.95, 0.1)
    for p, q, r in zip(params, flipped, ref):
        assert torch.equal(p.detach(), r) and torch.equal(q.detach(), r)


def test_a_step_over_shards_is_the_step_over_the_whole() -> None:
    """ZeRO steps each rank's flat slice: any cut of the elements must give the whole tensor's result bit for bit."""
    gen = torch.Generator().manual_seed(1)
    whole = torch.randn(1001, generator=gen)
    grads = [torch.randn(1001, generator=gen) for _ in range(3)]
    full, full_m = whole.clone(), torch.zeros(1001)
    cuts = [0, 250, 251, 700, 1001]
    shards = [whole[a:b].clone() for a, b in zip(cuts, cuts[1:])]
    shard_m = [torch.zeros_like(s) for s in shards]
    for g in grads:
        lion_step([full], [g], [full_m], lr=0.01, beta1=0.9, beta2=0.999, weight_decay=0.01)
        parts = [g[a:b] for a, b in zip(cuts, cuts[1:])]
        lion_step(shards, parts, shard_m, lr=0.01, beta1=0.9, beta2=0.999, weight_decay=0.01)
    assert torch.equal(torch.cat(shards), full) and torch.equal(torch.cat(shard_m), full_m)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [({"lr": -1.0}, "lr = -1.0"), ({"betas": (0.9, 1.0)}, "betas[1] = 1.0"), ({"weight_decay": -0.1}, "weight_decay")],
)
def test_lion_refuses_bad_hyperparameters(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        Lion([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_config_types_build_deepspeeds_defaults() -> None:
    lion = build_optimizer("lion", {}, [{"params": [torch.nn.Parameter(torch.ones(3))]}])
    assert type(lion) is Lion
    assert lion.defaults["lr"] == 1e-3 and lion.defaults["betas"] == (0.9, 0.999) and lion.defaults["weight_decay"] == 0
    ada = build_optimizer(
        "ADAGRAD", {"lr": 0.1, "weight_decay": 0.01}, [{"params": [torch.nn.Parameter(torch.ones(3))]}]
    )
    assert type(ada) is torch.optim.Adagrad
    assert ada.defaults["lr"] == 0.1 and ada.defaults["eps"] == 1e-10 and ada.defaults["weight_decay"] == 0.01
    with pytest.warns(UserWarning, match="set_grad_none"):  # FusedLion's zero_grad switch: accepted, no effect here
        cfg = load_config({"train_batch_size": 1, "optimizer": {"type": "Lion", "params": {"set_grad_none": False}}}, 1)
    assert cfg.optimizer.type == "Lion" and cfg.optimizer.decoupled_weight_decay
    assert dict(cfg.optimizer.resolved_params()) == {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "weight_decay": 0.0,
        "set_grad_none": False,
    }
    assert states_per_element(cfg) == 1
    cfg = load_config({"train_batch_size": 1, "optimizer": {"type": "adagrad"}}, 1)
    assert not cfg.optimizer.decoupled_weight_decay and states_per_element(cfg) == 1
    assert cfg.optimizer.resolved_params()["eps"] == 1e-10


@pytest.mark.parametrize(
    ("opt_type", "params", "fragment"),
    [
        ("Lion", {"eps": 1e-8}, "unknown config key 'optimizer.params.eps'"),
        ("Lion", {"betas": [0.9, 1.5]}, "optimizer.params.betas"),
        ("Adagrad", {"betas": [0.9, 0.99]}, "unknown config key 'optimizer.params.betas'"),
        ("Adagrad", {"eps": 0.0}, "optimizer.params.eps = 0.0 is invalid"),
    ],
)
def test_config_errors_name_the_key(opt_type: str, params: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace(".", r"\.").replace("[", r"\[")):
        load_config({"train_batch_size": 1, "optimizer": {"type": opt_type, "params": params}}, 1)


def test_deepspeed_classes_keep_deepspeeds_signatures() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    cpu = DeepSpeedCPULion(params)
    assert isinstance(cpu, Lion) and cpu.defaults["lr"] == 1e-3 and cpu.defaults["betas"] == (0.9, 0.999)
    fused = FusedLion(params, lr=0.1, set_grad_none=False)
    params[0].grad = torch.ones(3)
    fused.zero_grad()
    assert params[0].grad is not None and not params[0].grad.any()
    ada = DeepSpeedCPUAdagrad(params)
    assert isinstance(ada, torch.optim.Adagrad) and ada.defaults["lr"] == 1e-2 and ada.defaults["eps"] == 1e-10
    with pytest.raises(ValueError, match="fp32_optimizer_states=False"):
        DeepSpeedCPULion(params, fp32_optimizer_states=False)
    with pytest.raises(ValueError, match="amsgrad=True"):
        DeepSpeedCPUAdagrad(params, amsgrad=True)
    with pytest.raises(ValueError, match="adamw_mode=True"):
        DeepSpeedCPUAdagrad(params, adamw_mode=True)
    for client in (cpu, fused, ada):  # what initialize does with a client optimizer
        rebuilt = rebuild_optimizer(client, [[torch.nn.Parameter(torch.zeros(2))]])
        assert type(rebuilt) is type(client) and rebuilt.defaults == client.defaults
