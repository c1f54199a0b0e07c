"""Learnability probe for the embedded RLHF demo task ("reverse the digits"): plain SFT in one process, no engine.

    python bench/demo_task_probe.py [--seconds 90] [--batch 64] [--lr 3e-3] [--no-decay] [--n-eval 128] [--seed 0]
                                    [--data DIR] [--n-sft N] [--threads 1]

Builds the demo model from :func:`hybridzero.rlhf.data.demo_task.demo_model_config` (random init, seeded), trains it
with
AdamW (lr decaying linearly to 0 over the time budget) on the shipped ``sft.jsonl`` (loss on response tokens and eos
only, via :func:`hybridzero.rlhf.data.sft_example`)
for as many steps of ``--batch`` shuffled examples as fit in ``--seconds``, then decodes the first ``--n-eval``
held-out ``eval_prompts.jsonl`` prompts greedily and by sampling at temperature 1 and scores them with the hidden
rule. What to expect: the demonstrations are half correct reversals, half copies, so a policy that learned the
mixture samples ~50% reversals, and nearly every output is a correct reversal or a correct copy (``either``).
Prints one JSON object; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

from hybridzero.rlhf.data import (
    IGNORE_INDEX,
    SFT_COLUMNS,
    load_records,
    pad_sequences,
    prompt_batch,
    sft_example,
)
from hybridzero.rlhf.data.demo_task import (
    build_tokenizer,
    demo_data_dir,
    demo_model_config,
    rule_scores,
)

MAX_LEN = 16  # 5 digits + "=" + 5 digits + eos = 12 tokens at most
MAX_NEW_TOKENS = 8


def _batches(examples: Sequence[tuple[list[int], list[int]]], batch: int, seed: int) -> Any:
    """Endless shuffled batches of ``(input_ids, labels)`` pairs, reshuffled every epoch."""
    rng = random.Random(seed)
    order = list(range(len(examples)))
    while True:
        rng.shuffle(order)
        for start in range(0, len(order) - batch + 1, batch):
            yield [examples[i] for i in order[start : start + batch]]


def train(
    model: transformers.LlamaForCausalLM,
    examples: Sequence[tuple[list[int], list[int]]],
    pad_id: int,
    args: argparse.Namespace,
) -> dict[str, float]:
    """Train until ``args.seconds`` pass (lr decaying linearly to 0 over them unless ``--no-decay``).

    Returns steps, seconds per step, the first loss and the mean loss of the last 20 steps.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses: list[float] = []
    model.train()
    start = time.perf_counter()
    for rows in _batches(examples, args.batch, args.seed):
        if args.decay:  # linear decay to zero over the time budget (constant lr spikes late in training)
            for group in optimizer.param_groups:
                group["lr"] = args.lr * max(0.0, 1.0 - (time.perf_counter() - start) / args.seconds)
        input_ids = pad_sequences([ids for ids, _ in rows], pad_id)
        labels = pad_sequences([lab for _, lab in rows], IGNORE_INDEX)
        loss = model(input_ids=input_ids, attention_mask=(input_ids != pad_id).long(), labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if time.perf_counter() - start >= args.seconds:
            break
    elapsed = time.perf_counter() - start
    tail = losses[-20:]
    return {
        "steps": len(losses),
        "s_per_step": elapsed / len(losses),
        "final_loss": sum(tail) / len(tail),
        "first_loss": losses[0],
    }


@torch.no_grad()
def evaluate(
    model: transformers.LlamaForCausalLM,
    tok: transformers.PreTrainedTokenizerFast,
    prompts: list[str],
    sample: bool,
    seed: int,
) -> dict[str, float]:
    """Decode ``prompts`` (greedy or sampled at temperature 1) and score with the rule; adds ``either``."""
    model.eval()
    batch = prompt_batch(tok, prompts, max_prompt_len=MAX_LEN)
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        max_new_tokens=MAX_NEW_TOKENS,
        do_sample=sample,
        temperature=1.0 if sample else None,
        top_k=0 if sample else None,
        top_p=1.0 if sample else None,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    new = out[:, batch.input_ids.shape[1] :]
    responses = [tok.decode(row, skip_special_tokens=False) for row in new]
    scores = rule_scores(prompts, responses)
    scores["either"] = scores["exact"] + scores["copy"]
    return scores


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse flags, train, evaluate, print and return the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--no-decay", dest="decay", action="store_false", help="keep the lr constant")
    parser.add_argument("--n-eval", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data", type=Path, default=demo_data_dir())
    parser.add_argument("--n-sft", type=int, default=0, help="use only the first N SFT records (0: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = build_tokenizer()
    records = load_records(args.data / "sft.jsonl", columns=SFT_COLUMNS)
    records = records[: args.n_sft] if args.n_sft > 0 else records
    examples = [tuple(sft_example(tok, r["prompt"], r["response"], MAX_LEN))[:2] for r in records]
    prompts = [r["prompt"] for r in load_records(args.data / "eval_prompts.jsonl", columns=("prompt",))]
    prompts = prompts[: args.n_eval]
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(demo_model_config(tok))
    report: dict[str, Any] = {"n_sft": len(examples), "params": sum(p.numel() for p in model.parameters())}
    report["train"] = train(model, examples, int(tok.pad_token_id), args)
    report["greedy"] = evaluate(model, tok, prompts, sample=False, seed=args.seed)
    report["sampled_t1"] = evaluate(model, tok, prompts, sample=True, seed=args.seed)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
