"""DS-Chat LoRA (:mod:`hybridzero.lora`) in one process: init, conversion, the equivalence with peft (forward and
a few AdamW steps), merge/unmerge bit-exactness, the pure state-dict transforms."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hybridzero.lora import (
    LoRALinear,
    SourceWithExtra,
    convert_linear_layer_to_lora,
    initial_adapters,
    lora_layers,
    merged_lora,
    merged_weights,
    only_optimize_lora,
    peft_adapter_state,
)
from tests.harness.models import tiny_opt


def _lora_opt(r: int = 3, only: bool = True) -> nn.Module:
    model = tiny_opt(seed=0)
    names = convert_linear_layer_to_lora(model, "decoder.layers.", r, seed=7)
    assert names and all("decoder.layers." in n for n in names)
    if only:
        only_optimize_lora(model)
    return model


def test_init_scale_and_frozen_base_as_ds_chat() -> None:
    model = _lora_opt(r=4, only=False)
    for _, mod in lora_layers(model):
        assert mod.lora_right_weight.shape == (mod.in_features, 4)
        assert mod.lora_left_weight.shape == (4, mod.out_features)
        assert mod.lora_right_weight.abs().max() <= 1 / math.sqrt(4)  # kaiming a=sqrt(5) with fan-in r
        assert mod.lora_right_weight.abs().max() > 0.5 / math.sqrt(4)
        assert torch.count_nonzero(mod.lora_left_weight) == 0 and mod.lora_scaling == 1 / 4
        assert not mod.weight.requires_grad and (mod.bias is None or mod.bias.requires_grad)
    assert model.get_parameter("model.decoder.embed_tokens.weight").requires_grad  # only the converted base frozen
    only_optimize_lora(model)
    assert {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad} == {
        "lora_right_weight",
        "lora_left_weight",
    }


def test_conversion_is_seeded_and_names_a_bad_substring() -> None:
    a, b = _lora_opt(), _lora_opt()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    init = initial_adapters(a, seed=7)
    assert all(torch.equal(init[n], p.detach()) for n, p in a.named_parameters() if n in init)
    with pytest.raises(ValueError, match="'transformer.h.' matches no nn.Linear"):
        convert_linear_layer_to_lora(tiny_opt(seed=0), "transformer.h.", 2)
    with pytest.raises(ValueError, match="lora_dim = 0"):
        LoRALinear(nn.Linear(3, 5), 0)


def _peft_twin(ours: nn.Module, r: int) -> nn.Module:
    """peft's LoRA with DS-Chat's math (lora_alpha = 1) and our adapter values."""
    from peft import LoraConfig, get_peft_model

    targets = [n for n, _ in lora_layers(ours)]
    twin = get_peft_model(tiny_opt(seed=0), LoraConfig(r=r, lora_alpha=1, lora_dropout=0.0, target_modules=targets))
    with torch.no_grad():
        for name, mod in lora_layers(ours):
            layer = twin.base_model.model.get_submodule(name)
            layer.lora_A["default"].weight.copy_(mod.lora_right_weight.t())
            layer.lora_B["default"].weight.copy_(mod.lora_left_weight.t())
    return twin


def test_training_equals_peft_within_fp32_rounding() -> None:
    """Same init, data and plain SGD: losses and adapters agree with peft to fp32 rounding. The two compute
    ``(x R) L`` vs ``B(A x)``, equal up to the order of fp32 additions, so each gradient differs by a few ulps of its
    summands and SGD's parameters by ``lr`` times that per step (linear, so the bound holds for every entry). AdamW
    would divide each gradient by its own running magnitude: an entry that is a near-cancelling sum then carries a
    large relative rounding error into an update of size ``lr`` (seen: 2.3e-6 after 4 steps with peft 0.21), which
    no fixed tolerance bounds."""
    torch.manual_seed(0)
    ours = _lora_opt(r=3)
    twin = _peft_twin(ours, 3)
    ids = torch.randint(1, 90, (4, 2, 9))
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for m in (ours, twin)]
    for step in range(4):
        losses = []
        for model, opt in zip((ours, twin), opts):
            opt.zero_grad()
            loss = model(input_ids=ids[step], labels=ids[step]).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-6)
    for name, mod in lora_layers(ours):
        layer = twin.base_model.model.get_submodule(name)
        torch.testing.assert_close(mod.lora_right_weight.t(), layer.lora_A["default"].weight, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mod.lora_left_weight.t(), layer.lora_B["default"].weight, rtol=1e-5, atol=1e-6)


def test_merge_swaps_and_restores_bit_exactly() -> None:
    model = _lora_opt(r=2)
    with torch.no_grad():
        for _, mod in lora_layers(model):
            mod.lora_left_weight.normal_()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.arange(1, 10)[None]
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with merged_lora(model, writable=lambda p: False) as n:
            assert n == len(lora_layers(model))
            merged = model(input_ids=ids).logits
        with pytest.raises(RuntimeError, match="boom"), merged_lora(model, writable=lambda p: False):
            raise RuntimeError("boom")
    torch.testing.assert_close(merged, plain, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert not any(mod.merged for _, mod in lora_layers(model))


def test_state_transforms_and_source() -> None:
    model = _lora_opt(r=2)
    with torch.no_grad():
        for _, mod in lora_layers(model):
            mod.lora_left_weight.normal_()
    state = {n: p.detach() for n, p in model.named_parameters()}
    merged = merged_weights(state)
    assert not any("lora" in n for n in merged) and set(merged) == {n for n in state if "lora" not in n}
    name, mod = lora_layers(model)[0]
    want = mod.weight + (mod.lora_right_weight @ mod.lora_left_weight).t() / 2
    torch.testing.assert_close(merged[f"{name}.weight"], want.detach(), rtol=0, atol=1e-6)
    tensors, config = peft_adapter_state(state)
    assert config["r"] == 2 and config["lora_alpha"] == 1 and name in config["target_modules"]
    assert torch.equal(tensors[f"base_model.model.{name}.lora_A.weight"], mod.lora_right_weight.detach().t())
    with pytest.raises(ValueError, match="no LoRA adapters"):
        peft_adapter_state({"w": torch.zeros(2)})

    class Base:
        def names(self) -> list[str]:
            return ["a"]

        def shape(self, name: str) -> torch.Size:
            return torch.Size([3])

        def dtype(self, name: str) -> torch.dtype:
            return torch.float32

        def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
            return torch.arange(3.0)[lo:hi]

    src = SourceWithExtra(Base(), {"x.lora_right_weight": torch.ones(2, 2)})
    assert src.names() == ["a", "x.lora_right_weight"] and src.shape("x.lora_right_weight") == (2, 2)
    assert torch.equal(src.read_flat("x.lora_right_weight", 1, 3), torch.ones(2))
    assert torch.equal(src.read_flat("a", 0, 2), torch.arange(2.0))
    with pytest.raises(ValueError, match="bad range"):
        src.read_flat("x.lora_right_weight", 0, 5)
