"""Per-rank checks of Ulysses sequence parallelism (``sequence_parallel_size``), for the worker pool.

The model: a 2-block Llama with grouped-query attention whose head counts split over 2 ranks (4 query heads; 2 kv
heads split, 1 kv head is repeated; HF wants the hidden size, 28, divisible by them), vocabulary 113 and
intermediate 67 (odd: the ZeRO shards still pad). Sequences of 13
tokens (odd: the last rank's slice is right-padded).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.harness.models import tiny_llama

SEQ, MICRO, LAYERS = 13, 2, 2
CASES = (("eager", 2), ("sdpa", 1))  # (attention, kv heads): split kv heads / repeated kv heads


def sp_model(kv_heads: int, impl: str, seed: int = 0) -> torch.nn.Module:
    """The tiny GQA Llama of this file with attention ``impl``."""
    model = tiny_llama(seed, num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=6, hidden_size=28)
    model.config._attn_implementation = impl
    return model


def global_batches(dp: int, steps: int = 1, vocab: int = 113) -> torch.Tensor:
    """``[steps, dp, MICRO, SEQ]`` token ids: step ``t``'s batch of data-parallel rank ``d`` (same on every rank)."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab, (steps, dp, MICRO, SEQ), generator=gen)


def sp_config(world: int, sp: int, lr: float = 0.0) -> dict[str, Any]:
    """Stage 3, SGD (lr 0: the gradient checks leave the weights alone), batch = micro * dp."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "train_batch_size": MICRO * world // sp,
        "sequence_parallel_size": sp,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": lr}},
    }


def sp_gradients(sp: int) -> dict[str, Any]:
    """For each case: this rank's loss and, after one backward, the full reduced gradients and the ledger's
    sequence-parallel counts (forward and backward separately)."""
    import hybridzero
    from hybridzero.utils import safe_get_full_grad

    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    out: dict[str, Any] = {}
    for impl, kv in CASES:
        model = sp_model(kv, impl)
        engine, _, _, _ = hybridzero.initialize(model=model, config=sp_config(world, sp))
        sp_obj = engine.sequence_parallel
        ids = global_batches(world // sp)[0, rank // sp]
        batch = sp_obj.shard_batch(ids)
        ledger = engine.comm_ledger()
        ledger.reset()
        logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = sp_obj.loss(logits, batch["shift_labels"])
        fwd = ledger.copy()
        engine.backward(loss)
        bwd = ledger.since(fwd)
        grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
        out[f"{impl}/{kv}"] = {
            "loss": loss.item(),
            "grads": grads if rank == 0 else None,
            "a2a": (fwd.total("sp_all_to_all", "sp").calls, bwd.total("sp_all_to_all", "sp").calls),
            "a2a_bytes": fwd.total("sp_all_to_all", "sp").bytes,
            "loss_reduces": (fwd.total("all_reduce", "sp").calls, bwd.total("all_reduce", "sp").calls),
            "impl_during": model.config._attn_implementation,
            "local_len": int(batch["input_ids"].shape[1]),
        }
        engine.step()
        engine.destroy()
        out[f"{impl}/{kv}"]["impl_after"] = model.config._attn_implementation
    return out


def reference_gradients(dp: int) -> dict[str, Any]:
    """The ``s = 1`` math in this process: per case, the mean over data-parallel batches of each batch's HF loss
    (per-token mean) and the gradient of that mean."""
    out: dict[str, Any] = {}
    batches = global_batches(dp)[0]
    for impl, kv in CASES:
        model = sp_model(kv, impl)
        losses = []
        for d in range(dp):
            loss = model(input_ids=batches[d], labels=batches[d]).loss
            (loss / dp).backward()
            losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out[f"{impl}/{kv}"] = {"losses": losses, "grads": grads}
    return out


def sp_errors() -> dict[str, str]:
    """The one-line errors: s not dividing the world or the heads, a short sequence, an attention that cannot be split
    (every rank raises the same agreed error and stays usable)."""
    import hybridzero

    hybridzero.init_distributed()
    world = torch.distributed.get_world_size()
    got: dict[str, str] = {}

    def attempt(name: str, model: torch.nn.Module, cfg: dict[str, Any]) -> Any:
        try:
            return hybridzero.initialize(model=model, config=cfg)[0]
        except ValueError as exc:
            got[name] = str(exc).splitlines()[0]
            return None

    attempt("world", sp_model(2, "eager"), {**sp_config(world, 1), "sequence_parallel_size": 3})
    odd = tiny_llama(0)  # 5 query heads, 1 kv head
    attempt("heads", odd, sp_config(world, 2))
    attempt("impl", sp_model(2, "flex_attention"), sp_config(world, 2))
    engine = attempt("ok", sp_model(2, "eager"), sp_config(world, 2))
    try:
        engine.sequence_parallel.shard_batch(torch.ones(1, 1, dtype=torch.long))
    except ValueError as exc:
        got["short"] = str(exc)
    try:
        mask = torch.tensor([[0, 1, 1, 1]])
        engine.sequence_parallel.shard_batch(torch.ones(1, 4, dtype=torch.long), attention_mask=mask)
    except ValueError as exc:
        got["left_pad"] = str(exc)
    engine.destroy()
    return got


def generation_prompts(rank: int, vocab: int = 113) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of rank ``rank``'s own three prompts of 5 slots (one left-padded to 3 real
    tokens): different on every rank."""
    g = torch.Generator().manual_seed(77 + rank)
    ids = torch.randint(3, vocab, (3, 5), generator=g)
    mask = torch.ones_like(ids)
    ids[2, :2], mask[2, :2] = 0, 0
    return ids, mask


GEN_TOKENS = 6


def sp_generate(sp: int) -> dict[str, Any]:
    """Per case: the greedy tokens ``engine.generate`` gives for this rank's own prompts at ``sequence_parallel_size``
    ``sp`` (bucketed too), and the attention implementation during and after generation, with an SP training forward
    after it (its all-to-all count)."""
    import hybridzero

    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    out: dict[str, Any] = {}
    for impl, kv in CASES:
        model = sp_model(kv, impl)
        engine, _, _, _ = hybridzero.initialize(model=model, config=sp_config(world, sp))
        ids, mask = generation_prompts(rank)
        kwargs = {"attention_mask": mask, "max_new_tokens": GEN_TOKENS, "do_sample": False, "pad_token_id": 0}
        tokens = engine.generate(ids, **kwargs)
        bucketed = engine.generate(ids, max_gathered_bytes=1, **kwargs)
        with engine.generation_mode():
            during = model.config._attn_implementation
        ledger = engine.comm_ledger()
        ledger.reset()
        batch = engine.sequence_parallel.shard_batch(global_batches(world // sp)[0, rank // sp]) if sp > 1 else None
        if batch is not None:
            logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            engine.backward(engine.sequence_parallel.loss(logits, batch["shift_labels"]))
        out[f"{impl}/{kv}"] = {
            "tokens": tokens.tolist(),
            "bucketed": bucketed.tolist(),
            "during": during,
            "after": model.config._attn_implementation,
            "a2a": ledger.total("sp_all_to_all", "sp").calls,
        }
        engine.destroy()
    return out


def reference_generation(rank: int) -> dict[str, list[list[int]]]:
    """Per case: the plain model's greedy tokens (HF ``generate``, no engine) for rank ``rank``'s prompts."""
    out = {}
    for impl, kv in CASES:
        model = sp_model(kv, impl).eval()
        ids, mask = generation_prompts(rank)
        with torch.no_grad():
            tokens = model.generate(
                ids, attention_mask=mask, max_new_tokens=GEN_TOKENS, do_sample=False, pad_token_id=0
            )
        out[f"{impl}/{kv}"] = tokens.tolist()
    return out
