"""Per-rank body of tests/distributed/test_vllm_tp.py: a ZeRO-3 engine feeding a vLLM engine of
``tensor_parallel_size`` t (one per group of t ranks), its greedy and seeded tokens for this rank's prompts before
and after training updates, next to Hugging Face's greedy tokens for the trainer's full weights (module-level:
picklable for the pool)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ALL_PROMPTS", "NEW", "vllm_tp_tokens"]

ALL_PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [3], [40, 41, 42, 43, 44, 45, 46], [17, 18], [60, 61, 62, 63]]
NEW = 9
EOS = 2
_SHARES = {1: [6], 2: [4, 2], 4: [2, 1, 2, 1]}  # prompts per rank, unequal so the join must track the sizes


def tp_model(seed: int = 11) -> Any:
    """Head size 32 (vLLM's CPU attention), 4 query heads over 2 kv heads and an MLP of 66 (all split by 2); the
    residual stream (36) is not the attention's width (128) and the vocabulary (113) is odd (vLLM's vocab-parallel
    embedding pads it)."""
    from tests.harness.models import tiny_llama

    return tiny_llama(
        seed=seed,
        hidden_size=36,
        head_dim=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=66,
        max_position_embeddings=64,
    )


def _share(world: int, rank: int) -> tuple[int, int]:
    sizes = _SHARES[world]
    return sum(sizes[:rank]), sum(sizes[: rank + 1])


def _hf_greedy(engine: Any, prompts: list[list[int]], eos: int | None) -> list[list[int]]:
    """Greedy tokens of a plain HF copy of the trainer's full weights (fp32 argmax of the last position)."""
    from hybridzero.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    model = tp_model()
    model.load_state_dict(state)
    model.eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids, toks = torch.tensor([p]), []
            for _ in range(NEW):
                tok = int(model(input_ids=ids).logits[0, -1].argmax())
                toks.append(tok)
                if tok == eos:
                    break
                ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
            out.append(toks)
    return out


def _train(engine: Any, rank: int, world: int) -> None:
    """Three optimizer steps on rows of a fixed global batch (this rank's share of it)."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(3, 97, (4, 11), generator=gen)
        mine = ids[rank * 4 // world : (rank + 1) * 4 // world]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()


def vllm_tp_tokens(tp: int) -> dict[str, Any]:
    """This rank's vLLM tokens (greedy with and without EOS, seeded samples) and HF's greedy tokens, at the start
    weights and after three updates; plus the ledger's prompt all-gathers over the tensor-parallel group."""
    import hybridzero
    from hybridzero.rlhf.rollout.backends import SamplingSpec, VLLMEngine, VLLMOptions
    from hybridzero.rlhf.rollout.backends.vllm_rollout import ensure_synced
    from hybridzero.rlhf.rollout.backends.vllm_tp import group_generate

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = tp_model()
    cfg = {
        "train_micro_batch_size_per_gpu": 4 // world,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-2}},
    }
    engine, *_ = hybridzero.initialize(model=model, config=cfg, model_parameters=model.parameters())
    opts = VLLMOptions(dtype="fp32", kv_cache_gb=0.05, max_model_len=64, tensor_parallel_size=tp)
    vllm = VLLMEngine(engine.module.config, opts, world, rank)
    lo, hi = _share(world, rank)
    mine = ALL_PROMPTS[lo:hi]
    out: dict[str, Any] = {"rank": rank}
    try:
        for phase in ("start", "updated"):
            ensure_synced(vllm, engine)
            got = {
                "greedy": group_generate(vllm, vllm.group, mine, SamplingSpec(NEW, None)).tokens,
                "greedy_eos": group_generate(vllm, vllm.group, mine, SamplingSpec(NEW, EOS)).tokens,
                "sampled": group_generate(
                    vllm, vllm.group, mine, SamplingSpec(NEW, None, seeds=[1000 + i for i in range(lo, hi)])
                ).tokens,
                "hf": _hf_greedy(engine, mine, None),
                "hf_eos": _hf_greedy(engine, mine, EOS),
            }
            out[phase] = got
            if phase == "start":
                _train(engine, rank, world)
        ledger = engine.comm.ledger
        out["prompt_gathers"] = ledger.total("vllm_prompts", phase="rollout").calls
        out["syncs"] = vllm.stats.syncs
    finally:
        vllm.stop()
    return out
