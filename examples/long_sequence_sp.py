"""A sequence too long for one rank's activation budget trains with Ulysses sequence parallelism (s = 2).

    torchrun --nproc_per_node 2 examples/long_sequence_sp.py --seq_len 4096 --budget_mib 64

Every rank reads the same sequences; ``sequence_parallel_size`` = world size splits each one over the ranks
(``engine.sequence_parallel.shard_batch``), attention exchanges heads for positions with two all-to-alls per layer,
and ``engine.sequence_parallel.loss`` is the per-token mean over the whole sequence. Before training, the plan's
activation estimate (``hybridzero.plan.memory.activation_bytes``, as ``hybridzero plan`` reports it) is checked
against ``--budget_mib``: at s = 1 the sequence does not fit, at s = world it does. With ``--measure`` each rank
also reports the bytes autograd saved for backward in one forward (the activations the plan estimates), measured
with ``torch.autograd.graph.saved_tensors_hooks``. Rank 0 prints one JSON line: losses, estimates, measurement.
Run with one process (``python examples/long_sequence_sp.py --budget_mib 0``) it is the ``s = 1`` reference.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from typing import Any

import torch
import transformers

import hybridzero
from hybridzero.plan.memory import activation_bytes

VOCAB = 113


def tiny_llama(seq_len: int) -> transformers.LlamaForCausalLM:
    """A 2-block GQA Llama (4 query heads, 2 kv heads), eager attention, fixed weights."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=28,
        intermediate_size=67,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
        max_position_embeddings=seq_len,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config).float().train()


def sequences(steps: int, seq_len: int) -> torch.Tensor:
    """``[steps, 1, seq_len]`` fixed token rows (the same on every rank)."""
    return torch.randint(3, VOCAB, (steps, 1, seq_len), generator=torch.Generator().manual_seed(7))


def saved_activation_bytes(run: Callable[[], Any], params: Callable[[], set[int]]) -> tuple[Any, int]:
    """``run()`` and the bytes of the distinct storages autograd saved for backward meanwhile, parameters (storages
    in ``params``, looked up again at each save: ZeRO-3 gathers them during the forward) left out."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params():
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(seen.values())


def train(seq_len: int, steps: int, budget_mib: float, measure: bool = False) -> dict[str, Any]:
    """Train ``steps`` steps on this process's world with s = world size; returns losses and the memory figures.
    Raises ValueError when the plan's activation estimate at this s exceeds ``budget_mib`` (0: no budget)."""
    hybridzero.init_distributed()
    world = torch.distributed.get_world_size()
    model = tiny_llama(seq_len)
    estimate = {s: activation_bytes(model.config, 1, seq_len, 4, False, s) for s in (1, world)}
    budget = int(budget_mib * 2**20)
    if budget and estimate[world] > budget:
        raise ValueError(
            f"--seq_len {seq_len} needs ~{estimate[world] / 2**20:.1f} MiB of activations per rank at "
            f"sequence_parallel_size = {world}, over --budget_mib {budget_mib}; use more ranks or a shorter sequence"
        )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 1,
        "sequence_parallel_size": world,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
    }
    engine, _, _, _ = hybridzero.initialize(model=model, config=config)
    sp = engine.sequence_parallel
    params = list(model.parameters())
    losses, measured = [], 0

    def forward(ids: torch.Tensor) -> torch.Tensor:
        if sp is None:
            return engine(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]
        batch = sp.shard_batch(ids)
        logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        return sp.loss(logits, batch["shift_labels"])

    for ids in sequences(steps, seq_len):
        if measure and not losses:
            loss, measured = saved_activation_bytes(
                functools.partial(forward, ids), lambda: {p.untyped_storage().data_ptr() for p in params}
            )
        else:
            loss = forward(ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return {
        "world": world,
        "losses": losses,
        "estimate_bytes": {str(k): v for k, v in estimate.items()},
        "budget_bytes": budget,
        "fits_at_s1": not budget or estimate[1] <= budget,
        "saved_activation_bytes": measured,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget_mib", type=float, default=64.0, help="per-rank activation budget (0: none)")
    parser.add_argument("--measure", action="store_true", help="report the bytes saved for backward")
    args = parser.parse_args()
    result = train(args.seq_len, args.steps, args.budget_mib, args.measure)
    if torch.distributed.get_rank() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
