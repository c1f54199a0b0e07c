"""LoRA as DeepSpeed-Chat defines it (``utils/module/lora.py``), shaped for the sharded engine.

Math (DeepSpeed-Chat's ``LinearLayer_LoRA``, our :class:`LoRALinear`), for a base ``nn.Linear`` with weight
``W [out, in]`` and bias ``b``::

    y = x @ W.T + b + (x @ R @ L) * s        R = lora_right_weight [in, r]   L = lora_left_weight [r, out]
                                              s = lora_scaling / r  (DS-Chat passes lora_scaling = 1; dropout 0)

Init: ``R`` kaiming-uniform with ``a = sqrt(5)`` on the ``[in, r]`` tensor (so torch's fan-in is ``r``: bounds
``±1/sqrt(r)``), ``L`` zeros, so the adapted model starts equal to the base model. The base weight is frozen by the
conversion itself (DS-Chat freezes it in the layer's constructor; the bias stays trainable), and
``only_optimize_lora`` freezes everything that is not ``lora_right_weight`` / ``lora_left_weight``.

Why our own module and not ``peft``: peft's layer renames every base parameter (``base_layer.weight``, so
checkpoints and HF exports would need name rewriting), its default init differs from DS-Chat's (fan-in ``in``, not
``r``), and its merge/unmerge add and subtract in place, which is not bit-exact. Here the base names stay what the
HF model calls them, and merging for generation writes only into transient gathered buffers (or swapped copies)
that are dropped on exit, so the sharded masters are never touched. ``peft`` is still the interchange format:
:func:`peft_adapter_state` gives the tensors and config a ``PeftModel.from_pretrained`` loads with the same math
(``lora_alpha = lora_scaling``, so peft's ``alpha / r`` equals DS-Chat's scale).

This module imports nothing of hybridzero: the engine (hybrid generation), the checkpoint export and the RLHF steps
all use it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LORA_LEFT",
    "LORA_RIGHT",
    "LoRALinear",
    "SourceWithExtra",
    "convert_linear_layer_to_lora",
    "is_lora_name",
    "lora_delta",
    "lora_layers",
    "merged_lora",
    "merged_weights",
    "only_optimize_lora",
    "peft_adapter_state",
    "split_lora_groups",
]

LORA_RIGHT = "lora_right_weight"
LORA_LEFT = "lora_left_weight"


def is_lora_name(name: str) -> bool:
    """True for the parameter names of LoRA adapters (DS-Chat's rule: the name contains one of the two)."""
    return LORA_RIGHT in name or LORA_LEFT in name


def lora_delta(right: torch.Tensor, left: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling * (R @ L).T`` in fp32: the ``[out, in]`` update LoRA adds to the base weight (pure)."""
    return (right.float() @ left.float()).t() * scaling


class LoRALinear(nn.Module):
    """DeepSpeed-Chat's ``LinearLayer_LoRA``: the base ``weight`` / ``bias`` (same Parameter objects, same names)
    plus ``lora_right_weight [in, r]`` and ``lora_left_weight [r, out]``.

    ``merged`` is True only inside :func:`merged_lora`, where ``weight`` already holds ``W + s * (R @ L).T`` and
    the adapter term is skipped (DS-Chat's ``fuse_lora``)."""

    def __init__(
        self, base: nn.Linear, lora_dim: int, lora_scaling: float = 1.0, generator: torch.Generator | None = None
    ) -> None:
        super().__init__()
        if lora_dim <= 0:
            raise ValueError(f"lora_dim = {lora_dim} must be a positive integer")
        self.weight = base.weight
        self.bias = base.bias
        self.in_features, self.out_features = base.in_features, base.out_features
        self.lora_dim = lora_dim
        self.lora_scaling = lora_scaling / lora_dim
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_right_weight = nn.Parameter(torch.zeros(self.in_features, lora_dim, device=device, dtype=dtype))
        self.lora_left_weight = nn.Parameter(torch.zeros(lora_dim, self.out_features, device=device, dtype=dtype))
        self.merged = False
        self.weight.requires_grad = False  # DS-Chat: the base weight of a LoRA layer never trains
        if not self.weight.is_meta:
            with torch.no_grad():
                self.lora_right_weight.copy_(init_right(self.in_features, lora_dim, generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` plus the adapter term unless merged. x: [..., in] -> [..., out]."""
        out = F.linear(x, self.weight, self.bias)
        if self.merged:
            return out
        return out + (x @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, lora_dim={self.lora_dim}"


def init_right(in_features: int, lora_dim: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """DS-Chat's ``kaiming_uniform_(lora_right_weight, a=sqrt(5))`` on ``[in, r]``: uniform in ``±1/sqrt(r)``
    (torch's fan-in of a 2-D tensor is its second dimension), fp32 on CPU, from ``generator`` when given."""
    out = torch.empty(in_features, lora_dim)
    nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=generator)
    return out


def convert_linear_layer_to_lora(
    model: nn.Module, part_module_name: str | list[str], lora_dim: int, lora_scaling: float = 1.0, seed: int = 0
) -> list[str]:
    """Replace every ``nn.Linear`` whose qualified name contains ``part_module_name`` (or any of a list) by a
    :class:`LoRALinear` (DS-Chat's ``convert_linear_layer_to_lora``). Returns the converted module names, in
    module order; raises naming the substring when nothing matches (a typo would otherwise train nothing).

    Adapters are initialized from one generator seeded with ``seed``, in module order, so every rank builds the
    same values. On a meta-device model the adapters are meta too: read them with :class:`SourceWithExtra`."""
    parts = [part_module_name] if isinstance(part_module_name, str) else list(part_module_name)
    names = [
        name for name, mod in model.named_modules() if isinstance(mod, nn.Linear) and any(p in name for p in parts)
    ]
    if not names:
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:4]
        raise ValueError(
            f"lora_module_name {part_module_name!r} matches no nn.Linear of {type(model).__name__}; "
            f"it is a substring of module names such as {linears}"
        )
    generator = torch.Generator().manual_seed(seed)
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)  # names holds nn.Linear modules only
        setattr(parent, attr, LoRALinear(linear, lora_dim, lora_scaling, generator))
    return names


def initial_adapters(model: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """The initial adapter values :func:`convert_linear_layer_to_lora` gives (same seed, same order), by parameter
    name: what a meta-device model reads through :class:`SourceWithExtra`."""
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, mod in lora_layers(model):
        out[f"{name}.{LORA_RIGHT}"] = init_right(mod.in_features, mod.lora_dim, generator)
        out[f"{name}.{LORA_LEFT}"] = torch.zeros(mod.lora_dim, mod.out_features)
    return out


def only_optimize_lora(model: nn.Module, force_optimize_params: Sequence[str] = ()) -> None:
    """DS-Chat's ``only_optimize_lora_parameters``: only adapter parameters (and those named exactly in
    ``force_optimize_params``, e.g. step 2's value head) keep ``requires_grad``."""
    for name, p in model.named_parameters():
        p.requires_grad = is_lora_name(name) or name in force_optimize_params


def lora_layers(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """Every :class:`LoRALinear` of ``model`` with its qualified name, in module order."""
    return [(name, mod) for name, mod in model.named_modules() if isinstance(mod, LoRALinear)]


def split_lora_groups(model: nn.Module, weight_decay: float, lr: float, lora_lr: float) -> list[dict[str, Any]]:
    """Optimizer parameter groups as DS-Chat's ``get_optimizer_grouped_parameters(model, wd, lora_lr)``: trainable
    non-LoRA parameters at ``lr``, LoRA parameters at ``lora_lr`` (both with ``weight_decay``); empty groups left
    out. (Which parameters get no decay is the caller's rule; here every group carries ``weight_decay``.)"""
    base = [p for n, p in model.named_parameters() if p.requires_grad and not is_lora_name(n)]
    lora = [p for n, p in model.named_parameters() if p.requires_grad and is_lora_name(n)]
    groups = [
        {"params": base, "lr": lr, "weight_decay": weight_decay},
        {"params": lora, "lr": lora_lr, "weight_decay": weight_decay},
    ]
    return [g for g in groups if g["params"]]


@contextmanager
def merged_lora(
    model: nn.Module, writable: Callable[[torch.Tensor], bool], dtype: torch.dtype | None = None
) -> Iterator[int]:
    """Inside the block every :class:`LoRALinear` computes with ``W + s * (R @ L).T`` (DS-Chat's fuse) and skips
    its adapter term; yields the number of merged layers.

    The sum is formed in fp32 and rounded once to ``dtype`` (default: the weight's; the compute dtype under mixed
    precision). ``writable(weight)`` says whether the weight's current storage is a transient copy that may be
    overwritten (a gathered ZeRO-3 buffer, dropped on exit); otherwise the weight's ``.data`` is swapped for a
    merged copy and swapped back on exit. Either way the stored values (the shards) are never written, so leaving
    the block restores the unmerged model bit for bit, also on an exception."""
    swapped: list[tuple[LoRALinear, torch.Tensor]] = []
    layers = [mod for _, mod in lora_layers(model)]
    try:
        with torch.no_grad():
            for mod in layers:
                w = mod.weight
                merged = w.float() + lora_delta(mod.lora_right_weight, mod.lora_left_weight, mod.lora_scaling)
                merged = merged.to(dtype or w.dtype)
                if writable(w) and merged.dtype == w.dtype:
                    w.data.copy_(merged)
                else:
                    swapped.append((mod, w.data))
                    w.data = merged
                mod.merged = True
        yield len(layers)
    finally:
        for mod in layers:
            mod.merged = False
        for mod, data in swapped:
            mod.weight.data = data


def merged_weights(state: Mapping[str, torch.Tensor], scaling: float = 1.0) -> dict[str, torch.Tensor]:
    """A plain HF state dict from one with LoRA adapters (pure): each ``X.weight`` with ``X.lora_right_weight`` /
    ``X.lora_left_weight`` becomes ``W + (scaling / r) * (R @ L).T`` (fp32 sum, rounded to W's dtype); adapter
    entries are dropped. What DS-Chat's ``convert_lora_to_linear_layer`` then ``save_hf_format`` write."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if is_lora_name(name):
            continue
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        right = state.get(f"{prefix}.{LORA_RIGHT}") if prefix is not None else None
        if right is None:
            out[name] = value
            continue
        left = state[f"{prefix}.{LORA_LEFT}"]
        out[name] = (value.float() + lora_delta(right, left, scaling / right.shape[1])).to(value.dtype)
    return out


def peft_adapter_state(
    state: Mapping[str, torch.Tensor], base_model_name_or_path: str = "", lora_scaling: float = 1.0
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The adapters of ``state`` as peft saves them (``adapter_model.safetensors`` tensors and
    ``adapter_config.json`` content), pure: ``lora_A.weight = R.T [r, in]``, ``lora_B.weight = L.T [out, r]``
    under ``base_model.model.<module>``; ``lora_alpha = lora_scaling`` so peft's scale ``alpha / r`` is DS-Chat's.
    Raises if the adapters do not share one rank (peft's config holds one ``r``)."""
    tensors: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    ranks: set[int] = set()
    for name, value in state.items():
        if not name.endswith("." + LORA_RIGHT):
            continue
        module = name[: -len("." + LORA_RIGHT)]
        left = state[f"{module}.{LORA_LEFT}"]
        tensors[f"base_model.model.{module}.lora_A.weight"] = value.t().contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = left.t().contiguous()
        modules.append(module)
        ranks.add(int(value.shape[1]))
    if not modules:
        raise ValueError("no LoRA adapters (no parameter named *.lora_right_weight) in this model or checkpoint")
    if len(ranks) != 1:
        raise ValueError(f"LoRA adapters of different ranks {sorted(ranks)}: a peft config holds one r")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": ranks.pop(),
        "lora_alpha": lora_scaling,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": modules,
        "base_model_name_or_path": base_model_name_or_path,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "modules_to_save": None,
    }
    return tensors, config


class SourceWithExtra:
    """A ``TensorSource`` (see ``hybridzero.checkpoint.hf_source``) serving ``extra`` tensors by name and every
    other name from ``base``: a pretrained checkpoint plus freshly initialized adapters, read into shards."""

    def __init__(self, base: Any, extra: Mapping[str, torch.Tensor]) -> None:
        self.base = base
        self.extra = {n: t.detach().reshape(t.shape) for n, t in extra.items()}

    def names(self) -> list[str]:
        base = list(self.base.names())
        known = set(base)
        return base + [n for n in self.extra if n not in known]

    def shape(self, name: str) -> torch.Size:
        return self.extra[name].shape if name in self.extra else self.base.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.extra[name].dtype if name in self.extra else self.base.dtype(name)

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        if name not in self.extra:
            return self.base.read_flat(name, lo, hi)
        flat = self.extra[name].reshape(-1)
        if not 0 <= lo <= hi <= flat.numel():
            raise ValueError(f"bad range [{lo}, {hi}) for {name!r} with {flat.numel()} elements")
        return flat[lo:hi].clone()
