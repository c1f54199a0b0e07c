"""Token-budgeted vs whole packed training through ZeRO-3 engines (one rank's side; ``test_token_budget``).

Two identical fp32 ZeRO-3 engines (SGD with a real learning rate, gradient accumulation 2) train on the same
rank-local data: one with the whole micro-batch in one packed forward, the other with ``max_tokens_per_batch``
chunks (at least two per micro-batch; rank 1 has one more sequence than rank 0, so the ranks' chunk counts differ
and the stand-in chunks are exercised). Returned per side: the losses of every micro-step, the full gradients of the
first micro-step, the full parameters after the steps and the engine's counters.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from tests.workers.packing import _full_grads, _rollout_batch

BUDGET = 12  # the SFT micro-batches below hold 16-29 tokens; the RL rows 3-11 tokens, 8-9 rows
STEPS = 2


def _engines(name: str, seed: int, value_head: bool = False) -> tuple[Any, Any]:
    """Two identical fp32 ZeRO-3 engines, SGD lr 0.1, gradient accumulation 2 (``value_head``: a critic)."""
    import hybridzero
    from hybridzero.rlhf.models import ValueHeadModel
    from tests.harness.models import MODEL_FACTORIES

    world = torch.distributed.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 2 * world,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    out = []
    for _ in range(2):
        model = MODEL_FACTORIES[name](seed)
        model.set_attn_implementation("sdpa")
        torch.manual_seed(seed)  # the critic's trunk is initialised from the global RNG: the same on both sides
        module = ValueHeadModel(model.config, head_seed=9) if value_head else model
        engine, *_ = hybridzero.initialize(model=module, config=config, model_parameters=module.parameters())
        out.append(engine)
    return out[0], out[1]


def _full_params(engine: Any) -> dict[str, torch.Tensor]:
    from hybridzero import utils

    return {n: utils.safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def _examples(vocab: int, rank: int, step: int) -> list[tuple[list[int], list[int]]]:
    """Rank- and step-dependent SFT examples of 2-9 tokens; rank 1 has a sixth sequence (more chunks)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    lengths = (9, 2, 6, 4, 7, 8)[: 5 + min(rank, 1)]
    out = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        prompt = max(1, n // 3)
        out.append((ids, [-100] * prompt + ids[prompt:]))
    return out


def _counters(engine: Any) -> tuple[int, int]:
    return engine.micro_steps, engine.global_steps


def sft_budget_run(name: str) -> dict[str, Any]:
    """One rank: ``STEPS`` optimizer steps of SFT, whole packed vs chunked by :data:`BUDGET` tokens."""
    from hybridzero.packed_forward import packed_lm_loss
    from hybridzero.token_budget import budget_chunks, budget_lm_backward

    rank = torch.distributed.get_rank()
    whole, chunked = _engines(name, seed=3)
    vocab = int(whole.module.config.vocab_size)
    losses: list[tuple[float, float]] = []
    grads: tuple[dict[str, torch.Tensor], ...] = ()
    n_chunks = []
    for micro in range(2 * STEPS):
        examples = _examples(vocab, rank, micro)
        n_chunks.append(sum(c.weight for c in budget_chunks(chunked, [len(e[0]) for e in examples], BUDGET)))
        ref, _, _ = packed_lm_loss(whole, examples, pad_id=0)
        whole.backward(ref)
        got, _, _ = budget_lm_backward(chunked, examples, 0, BUDGET)
        losses.append((float(ref.detach()), got))
        if micro == 0:
            grads = (_full_grads(whole), _full_grads(chunked))
        whole.step()
        chunked.step()
    nested = False
    with chunked.backward_group():
        try:
            with chunked.backward_group():
                pass
        except RuntimeError:
            nested = True
    return {
        "nested_refused": nested,
        "loss": losses,
        "grads": grads,
        "params": (_full_params(whole), _full_params(chunked)),
        "counters": (_counters(whole), _counters(chunked)),
        "chunks": n_chunks,
    }


def _experience(vocab: int, rank: int, step: int) -> Any:
    from hybridzero.rlhf.rollout.experience import Experience

    seq, mask, action = _rollout_batch(vocab, 10 * rank + step)
    if rank:  # one more row on rank 1: the ranks' chunk counts differ
        seq, mask, action = (torch.cat([t, t[:1]]) for t in (seq, mask, action))
    g = torch.Generator().manual_seed(50 + rank + step)
    b, t = action.shape
    logprobs = -torch.rand(b, t, generator=g) * action
    values = torch.randn(b, t, generator=g) * action
    rewards = torch.randn(b, generator=g)
    return Experience(seq, mask, action, logprobs, logprobs - 0.01 * action, values, rewards)


def _grpo_settings(budget: int | None) -> Any:
    from hybridzero.rlhf.settings import GRPOSettings

    return GRPOSettings.model_construct(
        packing_samples=True,
        max_tokens_per_batch=budget,
        grpo_kl_coef=0.04,
        cliprange=0.2,
        clip_high=0.28,
        importance_sampling_level="token",
        loss_type="grpo",
        max_answer_seq_len=6,
    )


def grpo_budget_run(name: str) -> dict[str, Any]:
    """One rank: ``STEPS`` GRPO updates (real :func:`grpo_update`), whole packed vs chunked by :data:`BUDGET`."""
    from hybridzero.rlhf.steps.rl.grpo import grpo_update

    rank = torch.distributed.get_rank()
    whole, chunked = _engines(name, seed=5)
    vocab = int(whole.module.config.vocab_size)
    losses = []
    for micro in range(2 * STEPS):
        exp = _experience(vocab, rank, micro)
        adv = torch.linspace(-1.0, 1.0, exp.batch_size)
        every = torch.ones(exp.batch_size, dtype=torch.bool)
        pair = []
        for engine, budget in ((whole, None), (chunked, BUDGET)):
            run = SimpleNamespace(s=_grpo_settings(budget), roles=SimpleNamespace(actor=engine))
            pair.append(grpo_update(run, exp, adv, every, every))  # type: ignore[arg-type]
        losses.append((pair[0].actor_loss, pair[1].actor_loss, pair[0].clip_fraction, pair[1].clip_fraction))
    return {
        "loss": losses,
        "params": (_full_params(whole), _full_params(chunked)),
        "counters": (_counters(whole), _counters(chunked)),
    }


def ppo_budget_run(name: str) -> dict[str, Any]:
    """One rank: ``STEPS`` PPO updates (actor and critic), whole packed vs chunked; and the experience forwards
    (log-probs, values, last-token scores) whole vs chunked."""
    from hybridzero.packed_forward import packed_last_values
    from hybridzero.rlhf.rollout.generate import critic_values, sequence_logprobs
    from hybridzero.rlhf.steps.rl.ppo import ppo_update
    from hybridzero.token_budget import maybe_chunked

    rank = torch.distributed.get_rank()
    actors, critics = _engines(name, seed=7), _engines(name, seed=7, value_head=True)
    vocab = int(actors[0].module.config.vocab_size)
    exp = _experience(vocab, rank, 0)
    seq, mask = exp.sequences, exp.attention_mask
    actor, critic = actors[0], critics[0]
    forwards = []
    with torch.no_grad():
        for n in (None, BUDGET):
            logp = maybe_chunked(actor, lambda q, m: sequence_logprobs(actor, q, m, True, n), seq, mask, n)
            values = maybe_chunked(critic, lambda q, m: critic_values(critic, q, m, True, n), seq, mask, n)
            scores = maybe_chunked(critic, lambda q, m: packed_last_values(critic, q, m, capacity=n), seq, mask, n)
            forwards.append((logp, values, scores))
    losses = []
    for micro in range(2 * STEPS):
        exp = _experience(vocab, rank, micro)
        adv = torch.randn(exp.action_mask.shape, generator=torch.Generator().manual_seed(micro)) * exp.action_mask
        ret = exp.values + 0.5 * adv
        pair = []
        for i, budget in ((0, None), (1, BUDGET)):
            roles = SimpleNamespace(actor=actors[i], critic=critics[i])
            pair.append(ppo_update(roles, exp, adv, ret, clip=0.2, clip_value=0.2, packed=True, max_tokens=budget))  # type: ignore[arg-type]
        losses.append(tuple(getattr(p, k) for k in ("actor_loss", "critic_loss", "clip_fraction") for p in pair))
    return {
        "logprobs": (forwards[0][0], forwards[1][0]),
        "values": (forwards[0][1], forwards[1][1]),
        "scores": (forwards[0][2], forwards[1][2]),
        "loss": losses,
        "params": tuple((_full_params(actors[i]), _full_params(critics[i])) for i in (0, 1)),
        "counters": (_counters(actors[0]), _counters(actors[1])),
    }


def reward_budget_run(name: str) -> dict[str, Any]:
    """One rank: ``STEPS`` reward-model steps (pairwise loss), whole packed vs chunked by whole pairs."""
    from hybridzero.rlhf.steps.reward_model import _scores, budget_pair_backward, pair_stats

    rank = torch.distributed.get_rank()
    whole, chunked = _engines(name, seed=11, value_head=True)
    vocab = int(whole.module.config.vocab_size)
    losses = []
    for micro in range(2 * STEPS):
        examples = _examples(vocab, rank, micro)
        pairs = [(a[0][:6], b[0][:5]) for a, b in zip(examples, examples[1:] + examples[:1])]  # 2-11 tokens a pair
        loss, sums = pair_stats(*_scores(whole, pairs, 0, packed=True))
        whole.backward(loss)
        got = budget_pair_backward(chunked, pairs, 0, BUDGET)
        losses.append((sums["loss"], got["loss"], sums["pairs"], got["pairs"]))
        whole.step()
        chunked.step()
    return {
        "loss": losses,
        "params": (_full_params(whole), _full_params(chunked)),
        "counters": (_counters(whole), _counters(chunked)),
    }


def _lm_batch(examples: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """A right-padded ptx batch (labels: the tokens, -100 on padding) of the examples' token lists."""
    from hybridzero.rlhf.data.tokens import pad_sequences

    ids = pad_sequences([e[0] for e in examples], 0)
    mask = pad_sequences([[1] * len(e[0]) for e in examples], 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def ptx_eval_budget_run(name: str) -> dict[str, Any]:
    """One rank, whole vs chunked by :data:`BUDGET`: two ptx steps (``ptx_update``: losses, parameters after, the
    counters), SFT evaluation (``eval_loss``) and reward-model evaluation (all metrics) of held-out data."""
    from hybridzero.rlhf.steps.reward_model import _evaluate as reward_eval
    from hybridzero.rlhf.steps.rl.step3 import ptx_update
    from hybridzero.rlhf.steps.sft import _evaluate as sft_eval

    rank = torch.distributed.get_rank()
    whole, chunked = _engines(name, seed=7)
    vocab = int(whole.module.config.vocab_size)
    ptx = []
    for step in range(2):
        batch = _lm_batch(_examples(vocab, rank, 10 + step))
        ptx.append((ptx_update(whole, batch, 0.5), ptx_update(chunked, batch, 0.5, BUDGET)))
    held_out = _examples(vocab, 0, 20) + _examples(vocab, 1, 21)  # the same list on every rank, strided by rank
    sft = (sft_eval(whole, held_out, 0, 3)["eval_loss"], sft_eval(chunked, held_out, 0, 3, BUDGET)["eval_loss"])
    out = {
        "ptx": ptx,
        "params": (_full_params(whole), _full_params(chunked)),
        "counters": (_counters(whole), _counters(chunked)),
        "sft_eval": sft,
    }
    critics = _engines(name, seed=8, value_head=True)
    g = torch.Generator().manual_seed(31)
    pairs = [
        tuple(torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths)
        for lengths in ((5, 4), (3, 6), (2, 7), (4, 4), (6, 5))
    ]
    out["reward_eval"] = (reward_eval(critics[0], pairs, 0, 3), reward_eval(critics[1], pairs, 0, 3, BUDGET))
    return out
