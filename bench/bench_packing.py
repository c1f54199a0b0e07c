"""Tokens/s of training forwards+backwards, padded vs packed (``hybridzero.packed_forward``), interleaved A/B.

Two shapes: the demo's tiny Llama (``hybridzero.rlhf.data.demo_task.demo_model_config`` dims) and a randomly initialised
model with SmolLM2-135M's config (hidden 576, 9 heads / 3 kv heads, intermediate 1536, vocab 49152; ``--layers``
blocks, 30 in the real model). Two workloads per shape: SFT micro-batches (prompt+answer, right-padded) and GRPO
training forwards (rollout layout: left-padded prompts, right-padded answers; log-probs + backward). One process,
the model without an engine (packing changes the forward, not the sharding). A and B alternate in every repeat and
the table reports the ratio of medians, so a shared machine's load cancels out.

    python bench/bench_packing.py --repeats 5 --layers 4 --out packing.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch
import transformers

from hybridzero.packed_forward import packed_lm_loss, packed_logprobs
from hybridzero.packing import packed_slots
from hybridzero.rlhf.algorithms.ppo import gather_logprobs
from hybridzero.rlhf.models import position_ids


def _config(shape: str, layers: int) -> transformers.LlamaConfig:
    if shape == "demo":
        dims = dict(vocab_size=40, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4)
        return transformers.LlamaConfig(num_key_value_heads=2, head_dim=32, **dims)
    return transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )


def _lengths(shape: str, n: int, rng: random.Random) -> list[tuple[int, int]]:
    """(prompt, answer) token counts: the demo's (3-6 digit prompts, answers up to 6) or a chat-like spread."""
    if shape == "demo":
        return [(rng.randint(4, 8), rng.randint(2, 6)) for _ in range(n)]
    return [(rng.randint(16, 64), rng.randint(4, 64)) for _ in range(n)]


def _workloads(model: torch.nn.Module, shape: str, n: int, seed: int) -> dict[str, tuple[Callable[[], None], ...]]:
    rng = random.Random(seed)
    vocab = int(model.config.vocab_size)
    lens = _lengths(shape, n, rng)
    seqs = [[rng.randrange(3, vocab) for _ in range(p + a)] for p, a in lens]
    examples = [(s, [-100] * p + s[p:]) for s, (p, _) in zip(seqs, lens)]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = (torch.arange(width)[None] < torch.tensor([len(s) for s in seqs])[:, None]).long()
    labels = torch.tensor([e[1] + [-100] * (width - len(e[1])) for e in examples])
    pw, aw = max(p for p, _ in lens), max(a for _, a in lens)  # rollout layout: prompts left, answers right
    rids = torch.zeros(n, pw + aw, dtype=torch.long)
    rmask = torch.zeros_like(rids)
    for i, (s, (p, a)) in enumerate(zip(seqs, lens)):
        rids[i, pw - p : pw + a] = torch.tensor(s)
        rmask[i, pw - p : pw + a] = 1

    def sft_padded() -> None:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()

    def sft_packed() -> None:
        packed_lm_loss(model, examples, pad_id=0)[0].backward()

    def grpo_padded() -> None:
        logits = model(input_ids=rids, attention_mask=rmask, position_ids=position_ids(rmask), use_cache=False).logits
        gather_logprobs(logits[:, :-1], rids[:, 1:]).sum().backward()

    def grpo_packed() -> None:
        packed_logprobs(model, rids, rmask).sum().backward()

    real = float(mask.sum())
    pads = {
        "sft": (1 - real / ids.numel(), 1 - real / packed_slots(mask)),
        "grpo": (1 - real / rids.numel(), 1 - real / packed_slots(rmask)),
    }
    return {
        "sft": (sft_padded, sft_packed, real, *pads["sft"]),  # type: ignore[dict-item]
        "grpo": (grpo_padded, grpo_packed, real, *pads["grpo"]),  # type: ignore[dict-item]
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4, help="SmolLM2-shaped model's blocks (30 in SmolLM2-135M)")
    ap.add_argument("--batch", type=int, default=16, help="sequences per micro-batch")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="packing_bench.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for shape in ("demo", "smollm2"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(shape, args.layers))
        model.set_attn_implementation("sdpa")
        for task, (padded, packed, real, pad_a, pad_b) in _workloads(model, shape, args.batch, 1).items():
            times: dict[str, list[float]] = {"padded": [], "packed": []}
            padded(), packed()  # warm-up
            for _ in range(args.repeats):
                for name, fn in (("padded", padded), ("packed", packed)):
                    model.zero_grad(set_to_none=True)
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            a, b = statistics.median(times["padded"]), statistics.median(times["packed"])
            rows.append(
                {
                    "shape": shape,
                    "task": task,
                    "tokens": real,
                    "pad_fraction_padded": pad_a,
                    "pad_fraction_packed": pad_b,
                    "tokens_per_s_padded": real / a,
                    "tokens_per_s_packed": real / b,
                    "speedup": a / b,
                }
            )
            r = rows[-1]
            print(
                f"{shape:8s} {task:5s} pad {pad_a:.2f} -> {pad_b:.2f}  tok/s {r['tokens_per_s_padded']:9.0f} -> "
                f"{r['tokens_per_s_packed']:9.0f}  x{r['speedup']:.2f}",
                flush=True,
            )
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
