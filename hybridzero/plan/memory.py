"""Predicted bytes per rank: model states (the categories of ``engine.memory_report()``), activations, KV cache.

Pure functions of :class:`~hybridzero.plan.layout.GroupShape` lists. The model-state rules are the engine's
storage rules (``zero/groups.py``), each storage counted once as ``runtime/memory.py`` counts it:

* master (fp32): this rank's shard (``ZERO3``, ``PARAMS_WHOLE``) or the whole padded buffer (``DDP``, persistent);
* parameters: the bound whole buffer of always-full groups in the compute dtype -- none in fp32 when the master is
  whole (the buffer *is* the master);
* gradients: the fp32 gradient shard (none for frozen-only groups) plus, for ``DDP``, the whole fp32 gradient the
  step all-gathers;
* optimizer state: ``states_per_element`` fp32 tensors over the trainable range of this rank's master;
* placement: ZeRO-Offload puts master, gradients and optimizer state on the host; with NVMe the optimizer state and
  the sharded groups' fp32 masters are in files and each such group keeps a compute-dtype shard where
  ``compute_shards`` live (device, host with ``offload_param: cpu``, ``params.bin`` with ``offload_param: nvme``),
  exactly as ``zero.offload.Placement.where`` says.

Invariant (tested at world 1-4 against ``memory_report()``): every number is equal, byte for byte, on every rank.
Activation bytes are an estimate (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", eq. 2 without tensor parallelism), stated as such.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridzero.config import Config
from hybridzero.plan.layout import GroupShape
from hybridzero.zero.group_types import ShardMode
from hybridzero.zero.offload import Placement

__all__ = [
    "activation_bytes",
    "gathered_model_bytes",
    "kv_cache_bytes",
    "model_states",
    "states_per_element",
    "ulysses_all_to_all_bytes",
]

_CATEGORIES = ("parameters", "master_weights", "gradients", "optimizer_state")


def states_per_element(cfg: Config) -> int:
    """fp32 optimizer-state tensors per stepped element: Adam/AdamW 2 (3 with amsgrad), SGD 1 with momentum, Adagrad
    1 (its sum of squares), Lion 1 (its momentum)."""
    if cfg.optimizer is None:
        return 0
    params = dict(cfg.optimizer.params)
    if cfg.optimizer.type == "SGD":
        return 1 if float(params.get("momentum", 0.0)) != 0.0 else 0
    if cfg.optimizer.type in ("Adagrad", "Lion"):
        return 1
    return 3 if params.get("amsgrad") else 2


def model_states(groups: Sequence[GroupShape], cfg: Config, rank: int) -> dict[str, Any]:
    """Bytes of each model-state category on ``rank`` between steps, as ``engine.memory_report()`` reports them
    (``placement`` included; ``gathered`` is 0 between steps)."""
    item = cfg.compute_dtype.itemsize
    fp32 = cfg.compute_dtype.itemsize == 4
    master = params = grads = state_numel = 0
    for g in groups:
        lo, hi = g.master_range(rank)
        master += 4 * (hi - lo)
        if g.always_full and not (fp32 and g.master_is_whole):
            params += item * g.layout.padded_numel
        if not g.frozen_only:
            grads += 4 * g.layout.shard_numel
        if g.mode is ShardMode.DDP:
            grads += 4 * g.layout.padded_numel
        state_numel += g.optimizer_numel(rank)
    state = 4 * states_per_element(cfg) * state_numel
    off_opt, off_param = cfg.zero.offload_optimizer, cfg.zero.offload_param
    placement = Placement.build(torch.device("cpu"), off_opt.device, off_param.device, False)
    files = {"optimizer_state": 0, "master_weights": 0, "parameters": 0}
    kept = 0
    if placement.state_in_files:  # ZeRO-Infinity: state and the sharded groups' masters in files
        files["optimizer_state"], state = state, 0
        for g in groups:
            if not g.master_is_whole:
                lo, hi = g.master_range(rank)
                files["master_weights"] += 4 * (hi - lo)
                kept += item * (hi - lo)  # the compute-dtype shard kept in its place (or in params.bin)
        master -= files["master_weights"]
        if placement.where("compute_shards") == "file":
            files["parameters"], kept = kept, 0
    sizes = {"parameters": params, "master_weights": master, "gradients": grads, "optimizer_state": state}
    where: dict[str, dict[str, int]] = {"device": {}, "host": {}, "file": {}}
    for category in _CATEGORIES:
        place = placement.where(category)
        where["host" if place == "file" else place][category] = sizes[category]
    where["device"]["gathered"] = 0
    if kept:
        place = placement.where("compute_shards")
        where[place]["parameters"] = where[place].get("parameters", 0) + kept
    for category, nbytes in files.items():
        if nbytes or (category == "optimizer_state" and placement.state_in_files):
            where["file"][category] = nbytes
    return {
        "placement": where,
        "optimizer_state_file": files["optimizer_state"],
        "master_weights_file": files["master_weights"],
        "parameters_file": files["parameters"],
        **sizes,
        "parameters": params + kept,
        "model_states": params + kept + master + grads + state,
        "gathered": 0,
        "persisted_numel": sum(g.layout.padded_numel for g in groups if g.replicated),
    }


def gathered_model_bytes(groups: Sequence[GroupShape], itemsize: int) -> int:
    """Bytes of every ZeRO-3 group gathered at once (``runtime/hybrid.py::gathered_bytes``: the hybrid engine's
    generation buffers, compared with ``max_gathered_bytes``)."""
    return sum(g.layout.padded_numel * itemsize for g in groups if not g.always_full)


def activation_bytes(
    hf: Any, micro_batch: int, seq_len: int, itemsize: int, checkpointing: bool, sequence_parallel: int = 1
) -> int:
    """Estimated activation bytes of one micro-batch's forward kept for backward (one rank).

    Per layer ``s b h (34 + 5 a s / h)`` bytes for 16-bit activations (Korthikanti et al., eq. 2; x2 in fp32),
    plus logits ``s b V`` in the compute dtype and fp32 for the loss. With full activation checkpointing only each
    layer's input ``2 s b h`` (x2 in fp32) is kept, plus one layer's activations during its recomputation.
    Ulysses over ``sequence_parallel`` = p ranks divides every term by p: the ``34`` terms and the logits hold
    ``s / p`` positions, the attention term ``5 a s^2 b`` holds ``a / p`` heads over all ``s`` positions."""
    s, b = seq_len, micro_batch
    h = int(hf.hidden_size)
    a = int(hf.num_attention_heads)
    layers = int(hf.num_hidden_layers)
    scale = itemsize / 2 / sequence_parallel
    per_layer = s * b * h * (34 + 5 * a * s / h) * scale
    logits = s * b * int(hf.vocab_size) * (itemsize + 4) / sequence_parallel
    if checkpointing:
        return int(layers * 2 * s * b * h * scale + per_layer + logits)
    return int(layers * per_layer + logits)


def ulysses_all_to_all_bytes(hf: Any, micro_batch: int, seq_len: int, itemsize: int, sequence_parallel: int) -> int:
    """Whole-buffer bytes of one layer's two Ulysses all-to-alls in one forward on one rank (the backward moves the
    same again): the packed q|k|v of the local ``ceil(s / p)`` positions (kv heads repeated to the query heads when
    ``p`` does not divide them, as :mod:`hybridzero.runtime.ulysses` does) plus the output. 0 without SP."""
    p = sequence_parallel
    if p <= 1:
        return 0
    heads = int(hf.num_attention_heads)
    kv = int(getattr(hf, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
    kv_sent = kv if kv % p == 0 else heads
    local = -(-seq_len // p)
    return (heads + 2 * kv_sent + heads) * head_dim * local * micro_batch * itemsize


def kv_cache_bytes(hf: Any, batch: int, tokens: int, itemsize: int) -> int:
    """KV cache of generation: ``2 x layers x kv_heads x head_dim x tokens x batch`` elements."""
    heads = int(hf.num_attention_heads)
    kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
    return 2 * int(hf.num_hidden_layers) * kv_heads * head_dim * tokens * batch * itemsize
