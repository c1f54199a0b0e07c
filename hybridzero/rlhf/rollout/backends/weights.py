"""The actor's full weights under Hugging Face names, one block's ZeRO-3 groups at a time (bounded weight sync).

:func:`hf_weight_buckets` yields lists of ``(hf_name, tensor)``: first the groups that are always whole (ZeRO
stages 0-2, persistent small parameters), then, block by block in model order, the ZeRO-3 groups a block owns
(its trainable and its frozen group: a LoRA layer's base weight and adapters live in different ones). A block's
groups are gathered (counted in the ledger under phase ``"rollout_sync"``), handed out, and released before the
next block is gathered, so at most one block's full buffers exist beyond what the consumer keeps (vLLM copies
each tensor into its own parameters).

LoRA: a layer's base weight is handed out merged, ``W + s * (R @ L).T`` (fp32 sum, rounded once to the weight's
dtype: what the hybrid engine generates with), and the adapter tensors are not handed out. The tensors are views of
the gathered buffer or fresh merged copies; they are valid only until the next group is requested.

Invariant: the shards are never written; after the generator is exhausted (or closed) every group is as it was.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hybridzero.lora import LORA_LEFT, LORA_RIGHT, is_lora_name, lora_delta, lora_layers
from hybridzero.runtime.engine import Engine
from hybridzero.zero.groups import ShardedGroup

__all__ = ["SYNC_PHASE", "hf_weight_buckets", "strip_prefix"]

SYNC_PHASE = "rollout_sync"


def strip_prefix(name: str, prefix: str) -> str:
    """``name`` without a leading ``prefix`` (e.g. a wrapper's ``module.``); pure."""
    return name[len(prefix) :] if prefix and name.startswith(prefix) else name


def _lora_scalings(engine: Engine) -> dict[str, float]:
    """``{layer name: scaling}`` of every LoRA layer of the engine's module."""
    return {name: mod.lora_scaling for name, mod in lora_layers(engine.module)}


def _named(groups: list[ShardedGroup]) -> dict[str, torch.Tensor]:
    """``{name: data}`` of the groups' parameters (gathered or always whole)."""
    return {slot.spec.name: slot.param.data for g in groups for slot in g.slots}


def _merged(
    names: list[str], data: dict[str, torch.Tensor], scalings: dict[str, float]
) -> list[tuple[str, torch.Tensor]]:
    """``names`` (adapters dropped) as ``(hf_name, tensor)``; a LoRA layer's weight merged with its adapters."""
    out: list[tuple[str, torch.Tensor]] = []
    for name in names:
        if is_lora_name(name):
            continue
        value = data[name]
        layer = name[: -len(".weight")] if name.endswith(".weight") else None
        if layer is not None and layer in scalings:
            right, left = data.get(f"{layer}.{LORA_RIGHT}"), data.get(f"{layer}.{LORA_LEFT}")
            if right is None or left is None:
                raise RuntimeError(f"LoRA layer {layer}: its adapters are not in its block's gather groups")
            value = (value.float() + lora_delta(right, left, scalings[layer])).to(value.dtype)
        out.append((name, value))
    return out


def _blocks(groups: list[ShardedGroup]) -> list[list[ShardedGroup]]:
    """The ZeRO-3 groups by owning block (a block's trainable and frozen groups together), in model order."""
    blocks: dict[str, list[ShardedGroup]] = {}
    for g in groups:
        blocks.setdefault(g.owner if g.owner is not None else g.name, []).append(g)
    return list(blocks.values())


def hf_weight_buckets(engine: Engine) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """One list of ``(hf_name, tensor)`` for the always-whole groups, then one per block of ZeRO-3 groups (module
    docstring). Every rank must exhaust the generator in step: ZeRO-3 gathers are collectives."""
    coordinator = engine.coordinator
    coordinator.release_held()
    coordinator.assert_quiescent()
    scalings = _lora_scalings(engine)
    whole = [g for g in coordinator.groups if g.always_full]
    whole_data = _named(whole)
    if whole:
        yield _merged(list(whole_data), whole_data, scalings)
    for block in _blocks([g for g in coordinator.groups if not g.always_full]):
        for g in block:
            g.pins += 1
        try:
            for g in block:
                g.start_gather(SYNC_PHASE)
            for g in block:
                g.wait(SYNC_PHASE)
            data = _named(block)
            yield _merged(list(data), {**whole_data, **data}, scalings)
        finally:
            for g in block:
                g.pins -= 1
                coordinator.release(g)
