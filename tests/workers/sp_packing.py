"""Per-rank side of ``tests/distributed/test_sp_packing.py``: packed rows under Ulysses sequence parallelism.

The model is :mod:`tests.workers.sequence_parallel`'s tiny GQA Llama (both its cases). Each data-parallel group
trains on six SFT examples of 9, 7, 6, 4, 3 and 2 tokens (prompts masked with -100) packed into rows of 13 slots:
``[9, 4]``, ``[7, 6]``, ``[3, 2]`` (first-fit-decreasing), so at s = 2 a sequence crosses the slice boundary
(slot 7), positions restart inside both slices, and the odd width 13 is right-padded to 14.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.workers.sequence_parallel import CASES, sp_config, sp_model

CAPACITY = 13
LENGTHS = (9, 2, 6, 4, 7, 3)


def sft_examples(dp_rank: int, vocab: int = 113) -> list[tuple[list[int], list[int]]]:
    """Data-parallel group ``dp_rank``'s examples (the same on every rank of the group)."""
    g = torch.Generator().manual_seed(300 + dp_rank)
    out = []
    for n in LENGTHS:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        prompt = max(1, n // 3)
        out.append((ids, [-100] * prompt + ids[prompt:]))
    return out


def _run(engine: Any, examples: list[tuple[list[int], list[int]]], budget: bool) -> float:
    from hybridzero.packed_forward import packed_lm_loss
    from hybridzero.token_budget import budget_lm_backward

    if budget:  # chunks of <= CAPACITY tokens, each a packed row split over the group
        return budget_lm_backward(engine, examples, 0, CAPACITY)[0]
    loss, _, _ = packed_lm_loss(engine, examples, 0, capacity=CAPACITY)
    engine.backward(loss)
    return float(loss.detach())


def sp_packed_gradients(sp: int) -> dict[str, Any]:
    """Per case and mode (one packed forward; the token budget's chunks): this rank's loss, the full reduced
    gradients (rank 0) and the SP all-to-all count (forward and backward)."""
    import hybridzero
    from hybridzero.utils import safe_get_full_grad

    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    out: dict[str, Any] = {}
    for impl, kv in CASES:
        for budget in (False, True):
            model = sp_model(kv, impl)
            engine, _, _, _ = hybridzero.initialize(model=model, config=sp_config(world, sp))
            ledger = engine.comm_ledger()
            ledger.reset()
            loss = _run(engine, sft_examples(rank // sp), budget)
            grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
            out[f"{impl}/{kv}/{'budget' if budget else 'packed'}"] = {
                "loss": loss,
                "grads": grads if rank == 0 else None,
                "a2a": ledger.total("sp_all_to_all", "sp").calls if sp > 1 else 0,
            }
            engine.destroy()
    return out


def reference(dp: int) -> dict[str, Any]:
    """The ``s = 1`` math in this process, per case: the unpacked (right-padded) HF loss of each data-parallel
    group and the gradient of their mean; and the same from packed rows (``packed_lm_loss`` on the plain model)."""
    from hybridzero.packed_forward import packed_lm_loss
    from hybridzero.rlhf.steps.sft import sft_batch

    out: dict[str, Any] = {}
    for impl, kv in CASES:
        for packed in (False, True):
            model = sp_model(kv, impl)
            losses = []
            for d in range(dp):
                examples = sft_examples(d)
                if packed:
                    loss = packed_lm_loss(model, examples, 0, capacity=CAPACITY)[0]
                else:
                    loss = model(**sft_batch(examples, 0)).loss
                (loss / dp).backward()
                losses.append(loss.item())
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            out[f"{impl}/{kv}/{'packed' if packed else 'unpacked'}"] = {"losses": losses, "grads": grads}
    return out
