"""Packed vs padded training forwards through sharded engines (one rank's side; ``tests/distributed/test_packing``).

For each tiny model (Llama, OPT, GPT-2 shapes) two ZeRO-3 fp32 engines are built from the same seed: one runs the
padded forwards, the other the packed ones, on this rank's own data. Returned per model: the SFT loss and full
gradients; the GRPO rollout numbers (reward-model scores, group advantages, old log-probs) and the policy loss and
full gradients of one GRPO update. The test compares the two sides.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

MODEL_NAMES = ("llama", "opt", "gpt2_tied")


def _engines(name: str, seed: int, varlen: bool = False) -> tuple[Any, Any]:
    """Two identical fp32 ZeRO-3 engines (SGD: the test reads gradients only, before any step); ``varlen``: the
    second runs the flash-varlen reference attention (``tests/harness/varlen_reference.py``), the first sdpa."""
    import hybridzero
    from tests.harness.models import MODEL_FACTORIES
    from tests.harness.varlen_reference import register, use_reference

    world = torch.distributed.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": world,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
    }
    out = []
    for side in range(2):
        model = MODEL_FACTORIES[name](seed)
        model.set_attn_implementation("sdpa")
        if varlen and side == 1:
            register()
            use_reference(model)
        engine, *_ = hybridzero.initialize(model=model, config=config, model_parameters=model.parameters())
        out.append(engine)
    return out[0], out[1]


def _full_grads(engine: Any) -> dict[str, torch.Tensor]:
    from hybridzero import utils

    return {n: utils.safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}


def _sft_examples(vocab: int, rank: int) -> list[tuple[list[int], list[int]]]:
    """Five examples of 2-9 tokens (prompt masked with -100), different on every rank."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for n in (9, 2, 6, 4, 7):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        prompt = max(1, n // 3)
        out.append((ids, [-100] * prompt + ids[prompt:]))
    return out


def _sft(name: str, rank: int, varlen: bool = False) -> dict[str, Any]:
    from hybridzero.packed_forward import packed_lm_loss
    from hybridzero.rlhf.steps.sft import sft_batch

    padded, packed = _engines(name, seed=3, varlen=varlen)
    examples = _sft_examples(int(padded.module.config.vocab_size), rank)
    batch = sft_batch(examples, pad_id=0)
    ref = padded(**batch).loss
    padded.backward(ref)
    got, real, slots = packed_lm_loss(packed, examples, pad_id=0)
    packed.backward(got)
    return {
        "loss": (float(ref.detach()), float(got.detach())),
        "grads": (_full_grads(padded), _full_grads(packed)),
        "pad": (1 - real / batch["input_ids"].numel(), 1 - real / slots),
    }


def _rollout_batch(vocab: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sequences, attention_mask, action_mask)`` in the rollout layout: 8 samples (2 groups of 4), prompts of
    2-5 tokens left-padded to 5, answers of 1-6 tokens right-padded to 6."""
    g = torch.Generator().manual_seed(200 + rank)
    p_w, a_w, b = 5, 6, 8
    seq = torch.zeros(b, p_w + a_w, dtype=torch.long)
    mask = torch.zeros_like(seq)
    for i in range(b):
        p = int(torch.randint(2, p_w + 1, (1,), generator=g))
        a = int(torch.randint(1, a_w + 1, (1,), generator=g))
        seq[i, p_w - p : p_w + a] = torch.randint(3, vocab, (p + a,), generator=g)
        mask[i, p_w - p : p_w + a] = 1
    action = torch.zeros_like(mask[:, 1:])
    action[:, p_w - 1 :] = mask[:, p_w:]
    return seq, mask, action


def _grpo(name: str, rank: int, varlen: bool = False) -> dict[str, Any]:
    from hybridzero.packed_forward import packed_last_values
    from hybridzero.rlhf.algorithms.grpo import aggregate_loss, clipped_policy_loss, group_advantages
    from hybridzero.rlhf.models import ValueHeadModel, last_token_index
    from hybridzero.rlhf.rollout.generate import sequence_logprobs
    from tests.harness.varlen_reference import use_reference

    padded, packed = _engines(name, seed=5, varlen=varlen)
    seq, mask, action = _rollout_batch(int(padded.module.config.vocab_size), rank)
    scorer = ValueHeadModel(padded.module.config, head_seed=9).eval()  # the reward model (a trunk + head)
    packed_scorer = use_reference(copy.deepcopy(scorer)) if varlen else scorer
    with torch.no_grad():
        scores = (
            scorer(seq, mask).gather(1, last_token_index(mask)[:, None]).squeeze(1),
            packed_last_values(packed_scorer, seq, mask),
        )
        old = (sequence_logprobs(padded, seq, mask), sequence_logprobs(packed, seq, mask, packed=True))
    adv = tuple(group_advantages(s, 4, baseline="group_mean", scale="group") for s in scores)
    losses, grads = [], []
    for engine, is_packed in ((padded, False), (packed, True)):
        logp = sequence_logprobs(engine, seq, mask, packed=is_packed)
        out = clipped_policy_loss(
            logp, old[0] - 0.05, None, adv[0], action, eps_low=0.2, eps_high=0.28, level="token", beta=0.0
        )  # the same old log-probs and advantages on both sides: the difference is the forward alone
        loss = aggregate_loss(out.per_token, action, "grpo", num_seqs=8.0, num_tokens=float(action.sum()), max_len=6)
        engine.backward(loss)
        losses.append(float(loss.detach()))
        grads.append(_full_grads(engine))
    keep = action.bool()
    return {
        "scores": scores,
        "advantages": adv,
        "old_logprobs": (old[0][keep], old[1][keep]),
        "loss": tuple(losses),
        "grads": tuple(grads),
    }


def packing_parity_run(varlen: bool = False) -> dict[str, Any]:
    """One rank: SFT and GRPO packed-vs-padded numbers for every model of :data:`MODEL_NAMES`; ``varlen``: the
    packed side runs flash-varlen (the reference attention), the padded side sdpa."""
    rank = torch.distributed.get_rank()
    return {name: {"sft": _sft(name, rank, varlen), "grpo": _grpo(name, rank, varlen)} for name in MODEL_NAMES}
