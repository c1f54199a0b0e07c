"""Tests for hybridzero.optim.factory: DeepSpeed optimizer semantics (``build_optimizer``) and rebuilding a client
optimizer over the engine's shards (``rebuild_optimizer``), on one set of tensor fixtures. hybridzero.optim.clip is
tested in ``test_clip.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from hybridzero.optim.factory import (
    SUPPORTED_OPTIMIZERS,
    build_optimizer,
    param_groups_of,
    rebuild_optimizer,
)


# --- helpers
def _leaves(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(4, 3, generator=gen)),
        torch.nn.Parameter(torch.randn(5, generator=gen)),
    ]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int = 3) -> None:
    for step in range(steps):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g.clone()
        opt.step()


def _stepped_values(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> list[torch.Tensor]:
    params = _leaves()
    _run(make(params), params)
    return [p.detach().clone() for p in params]


def _assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


# --- build_optimizer
def test_supported_names() -> None:
    assert SUPPORTED_OPTIMIZERS == ("Adam", "AdamW", "SGD", "Adagrad", "Lion")


def test_adam_defaults_are_deepspeed_fused_adam_defaults() -> None:
    opt = build_optimizer("Adam", {}, [{"params": _leaves()}])
    assert type(opt) is torch.optim.AdamW
    assert opt.defaults["lr"] == 1e-3
    assert opt.defaults["betas"] == (0.9, 0.999)
    assert opt.defaults["eps"] == 1e-8
    assert opt.defaults["weight_decay"] == 0.0  # FusedAdam's default, not AdamW's 1e-2
    assert opt.defaults["amsgrad"] is False


@pytest.mark.parametrize(
    ("opt_type", "extra", "expected"),
    [
        ("Adam", {}, torch.optim.AdamW),
        ("Adam", {"adam_w_mode": True}, torch.optim.AdamW),
        ("Adam", {"adam_w_mode": False}, torch.optim.Adam),
        ("AdamW", {}, torch.optim.AdamW),
        ("AdamW", {"adam_w_mode": False}, torch.optim.AdamW),  # AdamW forces decoupled mode
        ("Adam", {"torch_adam": True}, torch.optim.AdamW),
        ("Adam", {"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam),
        ("AdamW", {"torch_adam": True, "adam_w_mode": False}, torch.optim.AdamW),
        ("adam", {}, torch.optim.AdamW),
        ("ADAMW", {}, torch.optim.AdamW),
        ("SGD", {}, torch.optim.SGD),
    ],
)
def test_class_selection(opt_type: str, extra: dict, expected: type) -> None:
    opt = build_optimizer(opt_type, {"lr": 0.01, **extra}, [{"params": _leaves()}])
    assert type(opt) is expected


def test_torch_adam_uses_torch_class_defaults() -> None:
    adamw = build_optimizer("AdamW", {"torch_adam": True}, [{"params": _leaves()}])
    assert adamw.defaults["weight_decay"] == 1e-2
    adam = build_optimizer("Adam", {"torch_adam": True, "adam_w_mode": False}, [{"params": _leaves()}])
    assert adam.defaults["weight_decay"] == 0


def test_adam_is_decoupled_weight_decay_by_default() -> None:
    cfg = {"lr": 0.05, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}
    ours = _stepped_values(lambda ps: build_optimizer("Adam", cfg, [{"params": ps}]))
    ref_w = _stepped_values(lambda ps: torch.optim.AdamW(ps, lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1))
    ref_l2 = _stepped_values(lambda ps: torch.optim.Adam(ps, lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1))
    _assert_bitwise(ours, ref_w)
    assert not torch.equal(ours[0], ref_l2[0])


def test_adam_w_mode_false_is_l2_adam() -> None:
    cfg = {"lr": 0.05, "weight_decay": 0.1, "adam_w_mode": False}
    ours = _stepped_values(lambda ps: build_optimizer("Adam", cfg, [{"params": ps}]))
    ref = _stepped_values(lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.1))
    _assert_bitwise(ours, ref)


def test_adamw_ignores_adam_w_mode_false() -> None:
    cfg = {"lr": 0.05, "weight_decay": 0.1, "adam_w_mode": False}
    ours = _stepped_values(lambda ps: build_optimizer("AdamW", cfg, [{"params": ps}]))
    ref = _stepped_values(lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1))
    _assert_bitwise(ours, ref)


def test_sgd_with_momentum_matches_torch() -> None:
    cfg = {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
    ours = _stepped_values(lambda ps: build_optimizer("SGD", cfg, [{"params": ps}]))
    ref = _stepped_values(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01))
    _assert_bitwise(ours, ref)


def test_per_group_overrides_win_and_params_not_mutated() -> None:
    a, b = _leaves()
    cfg = {"lr": 0.01, "weight_decay": 0.1}
    snapshot = copy.deepcopy(cfg)
    groups = [{"params": [a]}, {"params": [b], "weight_decay": 0.0, "lr": 0.5}]
    opt = build_optimizer("AdamW", cfg, groups)
    assert cfg == snapshot
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.5]
    assert "weight_decay" not in groups[0]  # caller's group dicts untouched


def test_torch_flags_pass_through() -> None:
    adam = build_optimizer("Adam", {"foreach": False, "maximize": True}, [{"params": _leaves()}])
    assert adam.defaults["foreach"] is False and adam.defaults["maximize"] is True
    sgd = build_optimizer("SGD", {"foreach": True, "momentum": 0.5}, [{"params": _leaves()}])
    assert sgd.defaults["foreach"] is True


def test_config_optimizers_default_to_foreach() -> None:
    assert build_optimizer("AdamW", {"lr": 0.01}, [{"params": _leaves()}]).defaults["foreach"] is True
    fused = build_optimizer("Adam", {"fused": True}, [{"params": _leaves()}])
    assert fused.defaults["foreach"] is None and fused.defaults["fused"] is True


@pytest.mark.parametrize(
    ("opt_type", "params"),
    [
        ("AdamW", {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}),
        ("Adam", {"lr": 1e-2, "weight_decay": 0.01, "adam_w_mode": False}),
        ("Adam", {"lr": 1e-3, "amsgrad": True, "torch_adam": True, "maximize": True}),
        ("SGD", {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    ],
)
def test_foreach_step_is_bitwise_the_per_tensor_step(opt_type: str, params: dict[str, object]) -> None:
    """The engine's default (foreach) changes no bit against torch's per-tensor loop, the reference's optimizer."""

    def run(foreach: bool) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        leaves = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (10_007, 37, 1)]
        opt = build_optimizer(opt_type, {**params, "foreach": foreach}, [{"params": leaves}])
        for step in range(4):
            for p in leaves:
                p.grad = torch.randn(p.shape, generator=gen) * 10.0 ** (step - 2)
            opt.param_groups[0]["lr"] *= 0.7  # a scheduler moving the rate
            opt.step()
        return [p.detach() for p in leaves]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


def test_amsgrad_only_with_torch_adam() -> None:
    opt = build_optimizer("Adam", {"amsgrad": True, "torch_adam": True}, [{"params": _leaves()}])
    assert opt.defaults["amsgrad"] is True
    with pytest.raises(ValueError, match=r"optimizer.params.amsgrad = true requires optimizer.params.torch_adam"):
        build_optimizer("Adam", {"amsgrad": True}, [{"params": _leaves()}])


@pytest.mark.parametrize("bad_type", ["Lamb", "SGDW", "OneBitAdam", ""])
def test_unknown_type_names_type_and_lists_supported(bad_type: str) -> None:
    with pytest.raises(ValueError) as info:
        build_optimizer(bad_type, {}, [{"params": _leaves()}])
    message = str(info.value)
    assert repr(bad_type) in message
    assert "Adam, AdamW, SGD, Adagrad, Lion" in message


@pytest.mark.parametrize(
    ("spelling", "cls"),
    [("sgd", torch.optim.SGD), ("SGD", torch.optim.SGD), ("adamw", torch.optim.AdamW), ("ADAM", torch.optim.AdamW)],
)
def test_type_names_are_case_insensitive_like_deepspeed(spelling: str, cls: type) -> None:
    """One rule for every type (the config's): DeepSpeed lower-cases optimizer names before matching."""
    assert type(build_optimizer(spelling, {}, [{"params": _leaves()}])) is cls


@pytest.mark.parametrize(
    ("opt_type", "key", "value"),
    [
        ("Adam", "momentum", 0.9),
        ("AdamW", "betas1", 0.9),
        ("SGD", "betas", [0.9, 0.99]),
        ("SGD", "torch_adam", True),
    ],
)
def test_unknown_param_names_key_and_value(opt_type: str, key: str, value: object) -> None:
    with pytest.raises(ValueError) as info:
        build_optimizer(opt_type, {key: value}, [{"params": _leaves()}])
    assert f"unknown config key 'optimizer.params.{key}'" in str(info.value)


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        (
            {"max_grad_norm": 1.0},
            "optimizer.params.max_grad_norm = 1.0 is not supported (as in DeepSpeed); set the "
            "top-level 'gradient_clipping'",
        ),
        ({"bias_correction": False}, "optimizer.params.bias_correction = false is not supported"),
        ({"adam_w_mode": "yes"}, "optimizer.params.adam_w_mode = 'yes' is invalid: expected true or false"),
        ({"torch_adam": 1}, "optimizer.params.torch_adam = 1 is invalid: expected true or false"),
        ({"betas": [0.9]}, "optimizer.params.betas = [0.9] is invalid: expected a pair [a, b] of numbers"),
        ({"lr": -1.0}, "optimizer.params.lr = -1.0 is invalid: expected a number >= 0"),
    ],
)
def test_invalid_adam_params(params: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        build_optimizer("Adam", params, [{"params": _leaves()}])
    assert fragment in str(info.value)


# --- rebuild_optimizer
def _client(cls: type[torch.optim.Optimizer], **defaults: object) -> torch.optim.Optimizer:
    a, b = _leaves()
    return cls([{"params": [a]}, {"params": [b], "lr": 0.3, "weight_decay": 0.0}], **defaults)


@pytest.mark.parametrize(
    ("cls", "defaults"),
    [
        (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05, "betas": (0.8, 0.9)}),
        (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.05, "amsgrad": True}),
        (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.05}),
        (torch.optim.RMSprop, {"lr": 0.01, "alpha": 0.9, "weight_decay": 0.05}),
        (torch.optim.Adagrad, {"lr": 0.01, "weight_decay": 0.05}),
    ],
)
def test_rebuild_keeps_class_defaults_and_group_hyperparameters(
    cls: type[torch.optim.Optimizer], defaults: dict
) -> None:
    client = _client(cls, **defaults)
    new = [[torch.nn.Parameter(torch.zeros(7))], [torch.nn.Parameter(torch.zeros(2))]]
    rebuilt = rebuild_optimizer(client, new)
    assert type(rebuilt) is cls
    assert rebuilt.defaults == client.defaults
    assert len(rebuilt.param_groups) == len(client.param_groups)
    for old_group, new_group, params in zip(client.param_groups, rebuilt.param_groups, new):
        assert new_group["params"] == params
        assert {k: v for k, v in new_group.items() if k != "params"} == {
            k: v for k, v in old_group.items() if k != "params"
        }


def test_rebuild_gives_bitwise_identical_updates() -> None:
    client_params = _leaves(seed=3)
    client = torch.optim.AdamW(
        [{"params": [client_params[0]]}, {"params": [client_params[1]], "lr": 0.2, "weight_decay": 0.0}],
        lr=0.05,
        weight_decay=0.1,
    )
    copies = [torch.nn.Parameter(p.detach().clone()) for p in client_params]
    rebuilt = rebuild_optimizer(client, [[copies[0]], [copies[1]]])
    _run(client, client_params, steps=4)
    _run(rebuilt, copies, steps=4)
    _assert_bitwise([p.detach() for p in client_params], [p.detach() for p in copies])


def test_rebuild_over_flat_shards_matches_full_update() -> None:
    """The ZeRO use: one group's parameters become flat shards on this rank."""
    full = torch.nn.Parameter(torch.randn(4, 6, generator=torch.Generator().manual_seed(7)))
    client = torch.optim.AdamW([full], lr=0.05, weight_decay=0.1)
    flat = full.detach().clone().reshape(-1)
    shards = [torch.nn.Parameter(flat[:10].clone()), torch.nn.Parameter(flat[10:].clone())]
    rebuilt = rebuild_optimizer(client, [shards])
    for step in range(3):
        grad = _grads([full], step)[0]
        full.grad = grad.clone()
        flat_grad = grad.reshape(-1)
        shards[0].grad, shards[1].grad = flat_grad[:10].clone(), flat_grad[10:].clone()
        client.step()
        rebuilt.step()
    assert torch.equal(torch.cat([s.detach() for s in shards]), full.detach().reshape(-1))


def test_rebuild_keeps_empty_groups_index_aligned() -> None:
    client = _client(torch.optim.AdamW, lr=0.01)
    only = torch.nn.Parameter(torch.ones(3))
    rebuilt = rebuild_optimizer(client, [[], [only]])
    assert len(rebuilt.param_groups) == 2
    assert rebuilt.param_groups[0]["params"] == []
    assert rebuilt.param_groups[1]["lr"] == 0.3
    only.grad = torch.ones(3)
    rebuilt.step()  # stepping over an empty group is a no-op
    assert not torch.equal(only.detach(), torch.ones(3))
    all_empty = rebuild_optimizer(client, [[], []])
    all_empty.step()
    assert [g["params"] for g in all_empty.param_groups] == [[], []]


def test_rebuild_hyperparameters_are_independent_copies() -> None:
    client = _client(torch.optim.AdamW, lr=0.01)
    rebuilt = rebuild_optimizer(client, [[torch.nn.Parameter(torch.ones(1))], []])
    rebuilt.param_groups[0]["lr"] = 123.0
    rebuilt.param_groups[0]["betas"] = (0.1, 0.2)
    assert client.param_groups[0]["lr"] == 0.01
    assert client.param_groups[0]["betas"] == (0.9, 0.999)


def test_rebuild_drops_param_names_of_named_client() -> None:
    model = torch.nn.Linear(3, 2)
    client = torch.optim.AdamW(model.named_parameters(), lr=0.01)
    assert "param_names" in client.param_groups[0]
    rebuilt = rebuild_optimizer(client, [[torch.nn.Parameter(torch.ones(4))]])
    assert "param_names" not in rebuilt.param_groups[0]


def test_rebuild_rejects_stepped_client() -> None:
    params = _leaves()
    client = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    _run(client, params, steps=1)
    with pytest.raises(ValueError, match="SGD optimizer already has state"):
        rebuild_optimizer(client, [[torch.nn.Parameter(torch.ones(1))]])


def test_rebuild_accepts_unstepped_adagrad_with_constructor_state() -> None:
    client = _client(torch.optim.Adagrad, lr=0.01)
    rebuilt = rebuild_optimizer(client, [[torch.nn.Parameter(torch.ones(2))], []])
    assert type(rebuilt) is torch.optim.Adagrad


def test_rebuild_rejects_wrong_group_count() -> None:
    client = _client(torch.optim.AdamW)
    with pytest.raises(ValueError, match="new_params has 1 groups but the AdamW client optimizer has 2"):
        rebuild_optimizer(client, [[]])


class _NeedsExtraArg(torch.optim.SGD):
    def __init__(self, params: object, extra: int, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        self.extra = extra


def test_rebuild_construction_failure_names_class() -> None:
    client = _NeedsExtraArg([torch.nn.Parameter(torch.ones(1))], extra=1)
    with pytest.raises(ValueError, match="_NeedsExtraArg"):
        rebuild_optimizer(client, [[torch.nn.Parameter(torch.ones(1))]])


def test_param_groups_of_returns_params_in_order() -> None:
    a, b = _leaves()
    c = torch.nn.Parameter(torch.ones(1))
    client = torch.optim.SGD([{"params": [a, c]}, {"params": [b]}], lr=0.1)
    groups = param_groups_of(client)
    assert [[id(p) for p in g] for g in groups] == [[id(a), id(c)], [id(b)]]
    groups[0].clear()
    assert len(client.param_groups[0]["params"]) == 2
