"""A training script written for DeepSpeed, run on hybridzero: the import line is its only difference.

    torchrun --nproc_per_node 2 examples/deepspeed_style_train.py --deepspeed --deepspeed_config ds.json --out DIR

It uses DeepSpeed's documented API as its users do: ``add_config_arguments``, ``init_distributed``, model
construction under ``zero.Init``, ``initialize(args=..., model=..., model_parameters=..., training_data=...)``,
a ``zero.GatheredParameters(..., modifier_rank=0)`` edit, ``utils.safe_get_full_grad`` at every optimizer boundary,
``save_checkpoint`` / ``load_checkpoint(load_module_only=True)`` in the middle of the run and ``save_16bit_model``
at the end. Each rank writes ``DIR/rank<r>.json`` (losses, full gradients, final fp32 values), so a
test can compare the run with a single-process reference (tests/integration/test_deepspeed_style_script.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.utils.data import Dataset

import hybridzero as deepspeed  # the DeepSpeed version of this script says: import deepspeed

WATCHED = ("lm_head.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight")
EDITED = "lm_head.weight"  # x -> 0.5 x + 0.01 on rank 0 after the first optimizer step (GatheredParameters)
EDIT_AFTER_STEP = 1
CHECKPOINT_AFTER_STEP = 2


def build_model(seed: int = 0) -> transformers.LlamaForCausalLM:
    """A tiny Llama (numels not divisible by 2, 3 or 4), deterministically initialised."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=89,
        hidden_size=35,
        intermediate_size=47,
        num_hidden_layers=2,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config)


class TokenData(Dataset):
    """``n`` random token sequences of length ``seq`` (fixed seed)."""

    def __init__(self, n: int, seq: int, vocab: int = 89, seed: int = 1234) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="DeepSpeed-style training of a tiny Llama")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--seq_len", type=int, default=9)
    parser.add_argument("--out", type=str, required=True, help="output directory")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def construct(args: argparse.Namespace) -> transformers.LlamaForCausalLM:
    """Build the model under ``zero.Init`` (never whole on one rank), as DeepSpeed users do for large models."""
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
        return build_model()


def checkpoint_roundtrip(engine: Any, out: Path) -> None:
    """Save, then load the module weights back (the optimizer state stays the in-memory one)."""
    ckpt = out / "checkpoints"
    engine.save_checkpoint(str(ckpt), tag="mid", client_state={"note": "mid-run"})
    path, client = engine.load_checkpoint(str(ckpt), tag="mid", load_module_only=True)
    assert path is not None and client is not None and client["note"] == "mid-run", (path, client)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    model = construct(args)
    with open(args.deepspeed_config) as f:
        batch = json.load(f)["train_batch_size"]
    data = TokenData(args.steps * batch, args.seq_len)
    engine, _, loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data
    )
    params = dict(engine.module.named_parameters())
    losses: list[float] = []
    grads: list[dict[str, list[float]]] = []
    for ids in loader:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if engine.is_gradient_accumulation_boundary():
            full = {n: deepspeed.utils.safe_get_full_grad(params[n]) for n in WATCHED}
            grads.append({n: g.reshape(-1).tolist() for n, g in full.items()})
        engine.step()
        losses.append(loss.item())
        at_boundary = len(losses) % engine.gradient_accumulation_steps() == 0
        if at_boundary and engine.global_steps == EDIT_AFTER_STEP:
            target = params[EDITED]
            with deepspeed.zero.GatheredParameters([target], modifier_rank=0), torch.no_grad():
                if rank == 0:
                    target.mul_(0.5).add_(0.01)
        if at_boundary and engine.global_steps == CHECKPOINT_AFTER_STEP:
            checkpoint_roundtrip(engine, Path(args.out))
    final = {n: deepspeed.utils.safe_get_full_fp32_param(params[n]).reshape(-1).tolist() for n in WATCHED}
    assert engine.save_16bit_model(args.out, "model_16bit.bin")  # needs stage3_gather_16bit_weights_on_model_save
    record = {
        "rank": rank,
        "world": world,
        "losses": losses,
        "grads": grads,
        "final": final,
        "steps": engine.global_steps,
        "stage": engine.zero_optimization_stage(),
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(record))
    engine.destroy()


if __name__ == "__main__":
    main()
