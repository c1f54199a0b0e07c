"""DeepSpeed-Chat step 3 (PPO) on four plain ZeRO-3 engines, without a hybrid engine, and its unsharded reference.

Per step, for each of ``generation_batches`` prompt batches: the actor generates greedily (eval mode, rank-dependent
``max_new_tokens`` so ranks finish at different decoding steps and HF's synced generation keeps the early ones
stepping); then, under ``no_grad`` in train mode, the actor and the frozen reference score the sequence's tokens, the
critic values every position and the reward model scores the last token. Then ``ppo_epochs × generation_batches``
training steps of actor and critic. The losses are a deterministic PPO sketch:

* per generated token ``j``: ``return_j = reward − kl_coef · (old_logp_j − ref_logp_j)`` and
  ``advantage_j = return_j − value_j`` (all from the no-grad pass);
* actor: ``−mean(advantage · exp(logp − old_logp))``; critic: ``mean((value − return)²)``.

:func:`engine_sequence` runs one rank's share (module-level: picklable for the worker pool);
:func:`reference_sequence` runs every rank's share in rank order in one process, with unsharded copies of the four
models, and combines gradients as the engine does (per step: the per-rank gradients summed in rank order in fp32,
divided by the world size), like :func:`tests.harness.parity.reference_run`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tests.harness.models import tiny_opt
from tests.workers.value_model import ValueModel

__all__ = ["RlhfSpec", "combined_step", "engine_sequence", "new_tokens", "reference_sequence"]

_PAD = 1  # tiny_opt's pad_token_id
_FIRST_TOKEN = 3  # prompts avoid pad (1) and bos/eos (2)


@dataclass(frozen=True)
class RlhfSpec:
    """One PPO run, identical on the engines and on the reference."""

    steps: int = 3
    generation_batches: int = 1
    ppo_epochs: int = 1
    prompts_per_rank: int = 2
    prompt_len: int = 3
    base_new_tokens: int = 2
    prefetch_bucket_size: int = 10**9
    lr: float = 1e-2
    kl_coef: float = 0.1
    seed: int = 0

    def replace(self, **changes: Any) -> RlhfSpec:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Experience:
    """One generated batch with everything the no-grad pass computed (positions from ``start`` on are generated)."""

    seqs: torch.Tensor  # [B, T] prompt + generated tokens
    old_logp: torch.Tensor  # [B, T-1] actor log-prob of token t+1 at position t
    returns: torch.Tensor  # [B, T-start-1]
    advantages: torch.Tensor  # [B, T-start-1]
    start: int


@dataclass(frozen=True)
class Models:
    """Actor and critic are trained; reference and reward are inference only. Each is a module or an engine."""

    actor: Any
    ref: Any
    critic: Any
    reward: Any


def new_tokens(spec: RlhfSpec, rank: int, batch: int) -> int:
    """``max_new_tokens`` of ``rank``'s ``batch``: differs between neighbouring ranks, so some stop early."""
    return spec.base_new_tokens + (rank + batch) % 3


def prompts_for(spec: RlhfSpec, world_size: int) -> torch.Tensor:
    """Prompt ids ``[steps, generation_batches, world, prompts_per_rank, prompt_len]`` from a private generator."""
    vocab = int(tiny_opt(spec.seed).config.vocab_size)
    shape = (spec.steps, spec.generation_batches, world_size, spec.prompts_per_rank, spec.prompt_len)
    generator = torch.Generator().manual_seed(spec.seed + 1)
    return torch.randint(_FIRST_TOKEN, vocab, shape, generator=generator, dtype=torch.int64)


def build_models(spec: RlhfSpec) -> Models:
    """Unsharded initial models: actor and reference share initial weights; critic and reward differ."""
    return Models(
        actor=tiny_opt(spec.seed),
        ref=tiny_opt(spec.seed),
        critic=ValueModel(spec.seed + 1),
        reward=ValueModel(spec.seed + 2),
    )


def token_logprobs(logits: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
    """Log-probability ``[B, T-1]`` of each next token ``seqs[:, t+1]`` under ``logits[:, t]``."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, seqs[:, 1:, None]).squeeze(-1)


def generate(actor: nn.Module, prompts: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy generation of up to ``max_new_tokens`` tokens (HF's own stopping: EOS or the length)."""
    with torch.no_grad():
        return actor.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=_PAD,
        )


def make_experience(models: Models, seqs: torch.Tensor, spec: RlhfSpec) -> Experience:
    """The no-grad scoring pass (train mode) over one generated batch."""
    start = spec.prompt_len - 1
    with torch.no_grad():
        old_logp = token_logprobs(models.actor(input_ids=seqs).logits, seqs)
        ref_logp = token_logprobs(models.ref(input_ids=seqs).logits, seqs)
        values = models.critic(seqs)
        reward = models.reward(seqs)[:, -1]
    returns = reward[:, None] - spec.kl_coef * (old_logp - ref_logp)[:, start:]
    return Experience(
        seqs=seqs, old_logp=old_logp, returns=returns, advantages=returns - values[:, start:-1], start=start
    )


def actor_loss(actor: Callable[..., Any], exp: Experience) -> torch.Tensor:
    """``−mean(advantage · ratio)`` over the generated tokens (ratio = exp(logp − old_logp))."""
    logp = token_logprobs(actor(input_ids=exp.seqs).logits, exp.seqs)[:, exp.start :]
    ratio = torch.exp(logp - exp.old_logp[:, exp.start :])
    return -(exp.advantages * ratio).mean()


def critic_loss(critic: Callable[..., Any], exp: Experience) -> torch.Tensor:
    """``mean((value − return)²)`` over the positions that generated a token."""
    values = critic(exp.seqs)[:, exp.start : -1]
    return (values - exp.returns).pow(2).mean()


# --- engine side (one rank) -------------------------------------------------------------------------------------------
def _ds_config(spec: RlhfSpec, world_size: int, trained: bool) -> dict[str, Any]:
    """ZeRO-3, nothing persistent, the spec's prefetch; an AdamW block only for the ``trained`` engines."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.prompts_per_rank,
        "gradient_accumulation_steps": 1,
        "train_batch_size": spec.prompts_per_rank * world_size,
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": spec.prefetch_bucket_size,
            "stage3_param_persistence_threshold": 0,
        },
    }
    if trained:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": spec.lr, "weight_decay": 0.01}}
    return cfg


def _quiescent(engines: Models, what: str) -> None:
    """``assert_quiescent()`` on all four engines, naming the engine and the phase that just ended."""
    for name in ("actor", "ref", "critic", "reward"):
        try:
            getattr(engines, name).assert_quiescent()
        except AssertionError as exc:
            raise AssertionError(f"{name} after {what}: {exc}") from exc


def _rollout(engines: Models, prompts: torch.Tensor, spec: RlhfSpec, rank: int, batch: int) -> Experience:
    """Generate (eval mode) and score (train mode, no grad) one batch, checking quiescence after each phase."""
    engines.actor.eval()
    seqs = generate(engines.actor.module, prompts, new_tokens(spec, rank, batch))
    _quiescent(engines, "generate")
    engines.actor.train()
    exp = make_experience(engines, seqs, spec)
    _quiescent(engines, "scoring")
    return exp


def engine_sequence(spec: RlhfSpec) -> dict[str, Any]:
    """This rank's share of the PPO run: its generated sequences, prefetches per engine and (rank 0) the final
    actor and critic parameters."""
    import hybridzero

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    models = build_models(spec)
    built = {}
    for name in ("actor", "ref", "critic", "reward"):
        cfg = _ds_config(spec, world, trained=name in ("actor", "critic"))
        built[name], *_ = hybridzero.initialize(model=getattr(models, name), config=cfg, record_events=True)
    engines = Models(**built)
    prompts = prompts_for(spec, world)
    generated: list[torch.Tensor] = []
    for step in range(spec.steps):
        exps = [_rollout(engines, prompts[step, b, rank], spec, rank, b) for b in range(spec.generation_batches)]
        generated += [exp.seqs for exp in exps]
        for _ in range(spec.ppo_epochs):
            for exp in exps:
                engines.actor.backward(actor_loss(engines.actor, exp))
                engines.actor.step()
                _quiescent(engines, f"actor training step in PPO step {step}")
                engines.critic.backward(critic_loss(engines.critic, exp))
                engines.critic.step()
                _quiescent(engines, f"critic training step in PPO step {step}")
    actor, critic = engines.actor.full_parameters(), engines.critic.full_parameters()  # collectives: every rank
    prefetches = {name: sum(1 for e in engine.events if e[0] == "prefetch") for name, engine in built.items()}
    return {
        "generated": generated,
        "actor": actor if rank == 0 else None,
        "critic": critic if rank == 0 else None,
        "prefetches": prefetches,
    }


# --- single-process reference -----------------------------------------------------------------------------------------
def combined_step(model: nn.Module, opt: torch.optim.Optimizer, losses: Sequence[Callable[[], torch.Tensor]]) -> None:
    """One optimizer step on the gradient the engine forms: Σ_r (in rank order, fp32) grad(loss_r), divided by W."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total: dict[str, torch.Tensor] = {}
    for loss_fn in losses:
        model.zero_grad(set_to_none=True)
        loss_fn().backward()
        for n, p in named:
            grad = p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
            if n in total:
                total[n].add_(grad)
            else:
                total[n] = grad.clone()
    for n, p in named:
        p.grad = total[n].div_(len(losses))
    opt.step()
    opt.zero_grad(set_to_none=True)


def _reference_rollouts(models: Models, prompts: torch.Tensor, spec: RlhfSpec, step: int) -> list[list[Experience]]:
    """``[batch][rank]`` experiences of one step, every rank's share in rank order."""
    out: list[list[Experience]] = []
    for b in range(spec.generation_batches):
        row = []
        for r in range(prompts.shape[2]):
            models.actor.eval()
            seqs = generate(models.actor, prompts[step, b, r], new_tokens(spec, r, b))
            models.actor.train()
            row.append(make_experience(models, seqs, spec))
        out.append(row)
    return out


def reference_sequence(spec: RlhfSpec, world_size: int) -> dict[str, Any]:
    """The whole run in this process, unsharded, fp32, one thread; generated sequences in ``[rank][i]`` order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' setting: same kernels, same rounding
    try:
        models = build_models(spec)
        opts = {
            name: torch.optim.AdamW(getattr(models, name).parameters(), lr=spec.lr, weight_decay=0.01)
            for name in ("actor", "critic")
        }
        prompts = prompts_for(spec, world_size)
        generated: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        for step in range(spec.steps):
            exps = _reference_rollouts(models, prompts, spec, step)
            for row in exps:
                for r, exp in enumerate(row):
                    generated[r].append(exp.seqs)
            for _ in range(spec.ppo_epochs):
                for row in exps:
                    combined_step(models.actor, opts["actor"], [lambda e=e: actor_loss(models.actor, e) for e in row])
                    combined_step(
                        models.critic, opts["critic"], [lambda e=e: critic_loss(models.critic, e) for e in row]
                    )
        return {
            "generated": generated,
            "actor": {n: p.detach().clone() for n, p in models.actor.named_parameters()},
            "critic": {n: p.detach().clone() for n, p in models.critic.named_parameters()},
        }
    finally:
        torch.set_num_threads(threads)
