"""Rollout generation speed, world 1: plain Hugging Face ``generate``, the ``hf`` rollout engine (hybrid engine on
a ZeRO-3 engine) and the ``vllm`` rollout engine (colocated, weights synced from that engine), same prompts.

    python bench/bench_rollout.py [--shape demo|smollm2|both] [--new_tokens N] [--prompts N] [--samples K]
    python bench/bench_rollout.py --model DIR [--new_tokens N] [--prompts N] [--samples K]

Shapes: ``demo`` (a tiny Llama: hidden 64, 2 layers, head size 32 so vLLM's CPU attention takes it) and
``smollm2`` (SmolLM2-135M's exact architecture: hidden 576, 30 layers, 9 heads / 3 kv heads, vocab 49152,
*randomly initialised*: speed does not depend on the weights' values). ``--model DIR`` measures a real model
instead (e.g. SmolLM2-135M-Instruct as ``examples/gguf_import.py`` writes it) on the chat prompts of
``bench/rl_chat_task.py`` rendered with its own template and tokenizer. Sampling at
temperature 1 with ``ignore EOS`` (every answer has exactly ``new_tokens`` tokens, so all three do the same work).
Prints tokens/s of each (generated tokens / wall seconds, the engine start and weight sync excluded and reported
apart) as a Markdown table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import transformers

SHAPES: dict[str, dict[str, Any]] = {
    "demo": dict(
        vocab_size=97, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
    ),
    "smollm2": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_theta=100000.0,
    ),
}  # fmt: skip


def _prompts(n: int, vocab: int, gen: torch.Generator) -> list[list[int]]:
    return [torch.randint(3, vocab, (int(torch.randint(8, 25, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]  # fmt: skip


def _hf_tokens_per_s(generate: Any, prompts: list[list[int]], samples: int, new: int) -> float:
    """Left-padded batch of every prompt x samples, sampled, no EOS stop."""
    rows = [p for p in prompts for _ in range(samples)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=True,
                       top_k=0, pad_token_id=0, eos_token_id=None)  # fmt: skip
    dt = time.perf_counter() - t0
    assert out.shape[1] == width + new
    return len(rows) * new / dt


def _real(model_dir: str, n_prompts: int) -> tuple[Any, list[list[int]]]:
    """A real model (fp32) and ``n_prompts`` chat prompts as token ids from its own tokenizer and template."""
    from rl_chat_task import chat_prompts

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, [list(tok(p)["input_ids"]) for p in chat_prompts(n_prompts, tok)]


def run_shape(name: str, n_prompts: int, samples: int, new: int, model_dir: str | None = None) -> dict[str, float]:
    import hybridzero
    from hybridzero.rlhf.rollout.backends import SamplingSpec, VLLMEngine, VLLMOptions

    if model_dir is not None:
        model, prompts = _real(model_dir, n_prompts)
    else:
        config = transformers.LlamaConfig(**SHAPES[name])
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        prompts = _prompts(n_prompts, config.vocab_size, torch.Generator().manual_seed(1))
    res = {"plain_hf": _hf_tokens_per_s(model.generate, prompts, samples, new)}
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    engine, *_ = hybridzero.initialize(model=model, config=cfg)
    res["hf_engine"] = _hf_tokens_per_s(engine.generate, prompts, samples, new)
    vllm = VLLMEngine(
        engine.module.config, VLLMOptions(kv_cache_gb=1.0, max_model_len=max(map(len, prompts)) + new), 1, 0
    )
    t0 = time.perf_counter()
    vllm.start()
    res["vllm_start_s"] = time.perf_counter() - t0
    res["vllm_sync_s"] = vllm.sync_weights(engine).seconds
    rows = [p for p in prompts for _ in range(samples)]
    spec = SamplingSpec(new, None, seeds=list(range(len(rows))), temperature=1.0)
    vllm.generate(rows[:2], SamplingSpec(2, None))  # first-call warm-up
    t0 = time.perf_counter()
    gens = vllm.generate(rows, spec)
    dt = time.perf_counter() - t0
    assert all(len(t) == new for t in gens.tokens)
    res["vllm"] = len(rows) * new / dt
    vllm.stop()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--shape", choices=["demo", "smollm2", "both"], default="both")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="a real model directory (replaces --shape)")
    a = ap.parse_args()
    shapes = [Path(a.model).name] if a.model else ["demo", "smollm2"] if a.shape == "both" else [a.shape]
    print("| shape | sequences x tokens | plain HF tok/s | hf engine tok/s | vllm tok/s | vllm/hf | vllm start s |"
          " sync s |\n|---|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for name in shapes:
        r = run_shape(name, a.prompts, a.samples, a.new_tokens, a.model)
        print(f"| {name} | {a.prompts * a.samples} x {a.new_tokens} | {r['plain_hf']:.0f} | {r['hf_engine']:.0f} | "
              f"{r['vllm']:.0f} | {r['vllm'] / r['hf_engine']:.2f}x | {r['vllm_start_s']:.1f} | "
              f"{r['vllm_sync_s']:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
