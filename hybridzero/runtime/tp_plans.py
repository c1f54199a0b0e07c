"""Which modules of a model family tensor-parallel generation splits, and how (pure data plus checks).

A :class:`Family` names the transformer layers' ``nn.ModuleList``, each layer's projections with their split
(:class:`Split`: column or row, see :mod:`hybridzero.runtime.tp_layers`) and the attributes a module's ``forward``
reads that must hold the *local* size (OPT's ``num_heads``, GPT-2's ``split_size``). Everything else -- embeddings,
positions, layer norms, the final norm, ``lm_head``, OPT-350m's ``project_in`` / ``project_out`` -- stays whole on
every rank. Supported: Llama (also grouped-query attention: query and key/value heads are split alike), OPT and
GPT-2; any other ``model_type`` is refused by name, as are head or intermediate sizes the group size does not divide.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

COLUMN = "column"
ROW = "row"


@dataclass(frozen=True)
class Split:
    """One projection of a layer: its path inside the layer, column or row split, how many fused chunks its output
    holds (3 for GPT-2's q|k|v) and whether its weight is stored ``[in, out]`` (GPT-2's ``Conv1D``)."""

    path: str
    kind: str
    chunks: int = 1
    transposed: bool = False


@dataclass(frozen=True)
class Family:
    """Tensor-parallel plan of one model family (see module docstring)."""

    name: str
    layers: str
    splits: tuple[Split, ...]
    sizes: Callable[[Any], dict[str, int]]  # config -> the sizes t must divide, by config key
    local_attrs: Callable[[Any, int], dict[str, dict[str, Any]]]  # (config, t) -> module path -> attribute values


def _llama_sizes(c: Any) -> dict[str, int]:
    return {
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads or c.num_attention_heads,
        "intermediate_size": c.intermediate_size,
    }


def _opt_sizes(c: Any) -> dict[str, int]:
    return {"num_attention_heads": c.num_attention_heads, "ffn_dim": c.ffn_dim}


def _gpt2_sizes(c: Any) -> dict[str, int]:
    return {"n_head": c.n_head, "n_inner": c.n_inner or 4 * c.n_embd}


FAMILIES: dict[str, Family] = {
    "llama": Family(
        "llama",
        "model.layers",
        (
            Split("self_attn.q_proj", COLUMN),
            Split("self_attn.k_proj", COLUMN),
            Split("self_attn.v_proj", COLUMN),
            Split("self_attn.o_proj", ROW),
            Split("mlp.gate_proj", COLUMN),
            Split("mlp.up_proj", COLUMN),
            Split("mlp.down_proj", ROW),
        ),
        _llama_sizes,
        lambda c, t: {},  # LlamaAttention reshapes with -1 heads: nothing to localize
    ),
    "opt": Family(
        "opt",
        "model.decoder.layers",
        (
            Split("self_attn.q_proj", COLUMN),
            Split("self_attn.k_proj", COLUMN),
            Split("self_attn.v_proj", COLUMN),
            Split("self_attn.out_proj", ROW),
            Split("fc1", COLUMN),
            Split("fc2", ROW),
        ),
        _opt_sizes,
        lambda c, t: {"self_attn": {"num_heads": c.num_attention_heads // t}},
    ),
    "gpt2": Family(
        "gpt2",
        "transformer.h",
        (
            Split("attn.c_attn", COLUMN, chunks=3, transposed=True),
            Split("attn.c_proj", ROW, transposed=True),
            Split("mlp.c_fc", COLUMN, transposed=True),
            Split("mlp.c_proj", ROW, transposed=True),
        ),
        _gpt2_sizes,
        lambda c, t: {"attn": {"split_size": c.n_embd // t, "num_heads": c.n_head // t}},
    ),
}


def family_of(module: nn.Module, tp: int) -> Family:
    """The plan for ``module`` at group size ``tp``; raises ``ValueError`` naming the model type or the sizes."""
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(str(model_type))
    if family is None:
        raise ValueError(
            f"hybrid_engine.inference_tp_size = {tp}: tensor-parallel generation supports the model types "
            f"{', '.join(sorted(FAMILIES))}; {type(module).__name__} has model_type {model_type!r} "
            "(use inference_tp_size 1 for it)"
        )
    sizes = family.sizes(config)
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        listed = ", ".join(f"{k} = {v}" for k, v in sizes.items())
        raise ValueError(
            f"hybrid_engine.inference_tp_size = {tp} must divide {', '.join(bad)} of {type(module).__name__} "
            f"({listed}): each rank of a tensor-parallel group holds whole heads and an equal part of the MLP; "
            "choose a size that divides all of them"
        )
    try:
        module.get_submodule(family.layers)
    except AttributeError as exc:
        raise ValueError(
            f"tensor-parallel generation: {type(module).__name__} (model_type {model_type!r}) has no layer list "
            f"at {family.layers!r}"
        ) from exc
    return family
