"""Step 3 on this rank: what the PPO (:mod:`hybridzero.rlhf.steps.rl.ppo`) and GRPO
(:mod:`hybridzero.rlhf.steps.rl.grpo`) trainers
share. :class:`Step3` is the run's state, built once (engines of each role, the prompts and how they are dealt, the
ptx stream); the functions below are the update steps both algorithms take.

Conventions of every update:

* Losses are **global** means: each rank scales its local mean by ``n_local * D / N_global`` over the ``D``
  data-parallel ranks (one counted all-reduce of the count, :func:`global_scale`), so the engine's gradient average
  over ranks is exactly the mean over the global mini-batch, whatever the world size (under sequence parallelism
  ``D = W / s``; the split forwards' backward supplies the factor ``s``).
* fp16: an overflow in the actor or the critic skips **both** updates (:func:`step_both`; the overflowing engine
  moves its loss scale, the other is skipped without touching its scale), as DeepSpeed-Chat's ``align_overflow``.
* Every metric is a per-sample or per-token global mean (sums all-reduced, then divided by global counts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import transformers
from transformers import PretrainedConfig

from hybridzero.packed_forward import check_packable, packed_lm_sums
from hybridzero.rlhf.data.dealing import Plan, epoch_order, make_plan, rank_prompts
from hybridzero.rlhf.data.ptx import PtxStream
from hybridzero.rlhf.data.tokens import load_prompt_rows, pad_token_id, prompt_tensors
from hybridzero.rlhf.engines import Roles, build_roles, data_sum, world_comm
from hybridzero.rlhf.models import load_tokenizer
from hybridzero.rlhf.rewards.sources import RewardSet
from hybridzero.rlhf.rollout.backends import VLLMEngine, build_vllm_engine, truncated_is_weights
from hybridzero.rlhf.rollout.backends.vllm_rollout import vllm_rollout
from hybridzero.rlhf.rollout.experience import Experience
from hybridzero.rlhf.rollout.generate import Rollout, make_experience, rollout, rollout_stats
from hybridzero.rlhf.rollout.sp_split import gather_rollout, generated_rows
from hybridzero.rlhf.settings import GRPOSettings, PPOSettings
from hybridzero.rlhf.steps.rl.old_policy import has_dropout, old_logprobs_from_update
from hybridzero.runtime.engine import Engine
from hybridzero.token_budget import budget_lm_backward

__all__ = [
    "Monitor",
    "RolloutBatch",
    "Step3",
    "UpdateStats",
    "global_scale",
    "mean_update_stats",
    "model_context",
    "ptx_update",
    "slice_experience",
    "step_both",
]

Monitor = Callable[[list[str], list[str]], dict[str, float]]  # (prompts, answers) -> per-sample sums


@dataclass(frozen=True)
class RolloutBatch:
    """One generation batch of this rank: its scored experience and, per sample, the index of its prompt."""

    exp: Experience
    prompt_ids: list[int]
    finished: torch.Tensor | None = None  # [B] bool: the answer ended (EOS or stop string) within the limit
    sample_ids: list[int] | None = None  # each row's sampling id (its seed with the run seed)
    is_weights: torch.Tensor | None = None  # [B, P+A-1] truncated IS weights (vLLM rollouts with the correction)
    policy_step: int | None = None  # no old log-prob pass: the actor's global_steps at rollout (.old_policy)


@dataclass(frozen=True)
class UpdateStats:
    """Detached scalars of one training step (global means)."""

    actor_loss: float
    critic_loss: float
    clip_fraction: float
    approx_kl: float
    skipped: bool


def model_context(hf_config: PretrainedConfig) -> int:
    """The model's context length (``max_position_embeddings`` or GPT-2's ``n_positions``)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"cannot tell the context length of {type(hf_config).__name__}: no max_position_embeddings")


class Step3:
    """State of one step-3 run on this rank: settings, tokenizer, prompts, :class:`Plan`, engines, ptx stream.

    Invariant: every rank holds the same prompts and plan; rank ``r``'s share of each batch comes from
    :func:`~hybridzero.rlhf.data.dealing.rank_prompts`. Owns a process (GRPO's reward worker): whoever builds it
    calls :meth:`close` when done (the trainer, in a ``finally``).
    """

    def __init__(self, s: PPOSettings, monitor: Monitor | None, reward_funcs: Sequence[Any] | None = None) -> None:
        self.s, self.monitor = s, monitor
        comm = world_comm()
        self.world, self.rank = comm.world_size, comm.rank
        self.tok = load_tokenizer(s.actor_model_name_or_path)
        self.hf_config = transformers.AutoConfig.from_pretrained(s.actor_model_name_or_path)
        self.prompts, self.prompt_extras, self.prompt_counts = load_prompt_rows(
            s, self.tok, model_context(self.hf_config)
        )
        # the prompts are dealt to data-parallel ranks: under sequence parallelism the s ranks of an SP group
        # (consecutive ranks) share one data rank's samples, each generating 1/s of them (:meth:`sample`)
        self.sp_size = int(getattr(s, "sequence_parallel_size", 1))
        self.data_world, self.data_rank = max(self.world // self.sp_size, 1), self.rank // self.sp_size
        self.plan: Plan = make_plan(s, self.data_world, len(self.prompts))
        # GRPO's reward sources (functions loaded here: a bad spec fails before any engine exists); their worker is
        # forked now, while this process is small (RewardSet.start), and closed by close() -- here too on failure
        self.rewarder = RewardSet.build(s, reward_funcs or []) if isinstance(s, GRPOSettings) else None
        try:
            if self.rewarder is not None:
                self.rewarder.start(comm)  # imports the reward modules in the worker; every rank agrees
            with_model = self.rewarder.with_model if self.rewarder is not None else True
            self.roles: Roles = build_roles(s, self.world, self.plan.schedule_iterations, with_model)
            if s.packing_samples:
                for engine in (self.roles.actor, self.roles.ref, self.roles.reward, self.roles.critic):
                    # an SP engine's attention is the Ulysses wrapper (its core was checked sdpa/eager at build)
                    if engine is not None and engine.sequence_parallel is None:
                        check_packable(getattr(engine.module, "config", None))
            self.actor_dropout = has_dropout(self.roles.actor.module)  # train-mode forwards differ from eval's
            self.pad_id = pad_token_id(self.tok, pad_to_eos=True)
            self.eos_id = self.tok.eos_token_id
            # ptx batches are dealt to data-parallel ranks too: an SP group shares one slice, split by sequence
            self.ptx = PtxStream(s, self.tok, self.pad_id, self.data_rank, self.data_world) if s.ptx_enabled else None
            self.vllm: VLLMEngine | None = None  # started at the first rollout (its weight sync is collective)
            if self.roles.actor.config.hybrid_engine.rollout_engine == "vllm":  # set from s.rollout_engine
                self.vllm = build_vllm_engine(s, cast(Any, self.roles.actor.module).config, self.world, self.rank)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release what outlives a run: the reward functions' worker process (idempotent)."""
        if self.rewarder is not None:
            self.rewarder.close()
        vllm: VLLMEngine | None = getattr(self, "vllm", None)  # None too when __init__ failed before building it
        if vllm is not None:
            vllm.stop()

    def sync_seconds(self) -> float:
        """Seconds this rank's vLLM engine spent in weight syncs so far (0 with rollout_engine hf)."""
        return self.vllm.stats.seconds if self.vllm is not None else 0.0

    @property
    def updates_per_iteration(self) -> int:
        """Training mini-batches per iteration and PPO epoch (each followed by a ptx step when ptx is on)."""
        s = self.s
        return s.generation_batches * (s.per_device_generation_batch_size // s.per_device_training_batch_size)

    def rollout(self, it: int, batch: int) -> RolloutBatch:
        """Generate and score generation batch ``batch`` of iteration ``it`` (this rank's share)."""
        plan, s = self.plan, self.s
        epoch, pos = divmod(it, plan.iterations_per_epoch)
        order = epoch_order(plan.n_prompts, s.seed, epoch)
        positions = rank_prompts(order, plan, pos, batch, self.data_rank)
        prompt_ids = [order[q] for q in positions for _ in range(plan.k)]
        return self.sample(prompt_ids, plan.sample_ids(positions, epoch), s.seed)

    def sample(self, prompt_ids: list[int], sample_ids: list[int], run_seed: int) -> RolloutBatch:
        """Generate one answer per entry of ``prompt_ids`` (sampling ids ``sample_ids``, run seed ``run_seed``) and
        score them; every rank calls it the same number of times (generation and scoring gather parameters). Under
        sequence parallelism the SP group splits the samples: this rank generates its share and the group's rows
        are all-gathered (:mod:`~hybridzero.rlhf.rollout.sp_split`), so every rank of the group scores the same
        whole rows, bitwise equal, in the order of ``prompt_ids``."""
        sp = self.roles.actor.sequence_parallel
        n = len(prompt_ids)
        mine = generated_rows(n, sp.size, sp.comm.rank) if sp is not None else list(range(n))
        ro, sampler = self._generate([prompt_ids[i] for i in mine], [sample_ids[i] for i in mine], run_seed)
        if sp is not None:
            ro, sampler = gather_rollout(sp.comm, ro, sampler, n)
        return self._scored(ro, prompt_ids, sample_ids, sampler)

    def _generate(
        self, prompt_ids: list[int], sample_ids: list[int], run_seed: int
    ) -> tuple[Rollout, torch.Tensor | None]:
        """This rank's rollout of ``prompt_ids`` on the run's rollout engine, with the sampler's log-probs when the
        importance-sampling correction needs them (vLLM; else ``None``). The colocated vLLM engine is synced from
        the actor first if the actor has stepped (collective over the world)."""
        s, actor = self.s, self.roles.actor
        ids, mask = prompt_tensors(self.tok, [self.prompts[i] for i in prompt_ids], self.pad_id)
        ids, mask = ids.to(actor.device), mask.to(actor.device)
        decoding = self._decoding(sample_ids, run_seed)
        if self.vllm is not None:
            ro, sampler = vllm_rollout(self.vllm, actor, ids, mask, **decoding)
            return ro, sampler if s.vllm_importance_sampling_correction else None
        generate: Callable[..., torch.Tensor] = (
            actor.generate if s.enable_hybrid_engine else cast(Any, actor.module).generate
        )
        sp = actor.sequence_parallel
        local = sp.local_attention() if sp is not None and not s.enable_hybrid_engine else contextlib.nullcontext()
        with local:  # a decode step cannot be split over the SP group (engine.generate does this itself)
            return rollout(generate, ids, mask, **decoding), None

    def _decoding(self, sample_ids: list[int], run_seed: int) -> dict[str, Any]:
        """The decoding keywords both rollout engines take (seeds, widths, special ids, sampling, stop strings)."""
        s = self.s
        return {
            "sample_ids": sample_ids,
            "run_seed": run_seed,
            "prompt_width": s.max_prompt_seq_len,
            "answer_len": s.max_answer_seq_len,
            "pad_id": self.pad_id,
            "eos_id": self.eos_id,
            "do_sample": s.do_sample,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "stop": (self.tok, s.stop_strings) if isinstance(s, GRPOSettings) and s.stop_strings else None,
        }

    def _scored(
        self, ro: Rollout, prompt_ids: list[int], sample_ids: list[int], sampler: torch.Tensor | None = None
    ) -> RolloutBatch:
        """Score a rollout with every role; with the sampler's log-probs and the correction on, its IS weights."""
        s = self.s
        with_ref = not isinstance(s, GRPOSettings) or s.grpo_kl_coef > 0  # GRPO without a KL term: no reference pass
        actor = self.roles.actor
        on_policy = old_logprobs_from_update(
            s, self.updates_per_iteration, actor.micro_steps, dropout=self.actor_dropout, ptx=self.ptx is not None
        )
        exp = make_experience(
            self.roles,
            ro,
            with_ref=with_ref,
            packed=s.packing_samples,
            max_tokens=s.max_tokens_per_batch,
            with_old=not on_policy,
        )
        weights = None
        if sampler is not None:  # _generate gives the sampler's log-probs only with the correction on
            weights = truncated_is_weights(exp.logprobs, sampler, exp.action_mask, s.vllm_importance_sampling_cap)
        return RolloutBatch(
            exp, prompt_ids, ro.finished, sample_ids, weights, actor.global_steps if on_policy else None
        )

    def minibatches(self, exp: Experience) -> Iterator[tuple[int, int]]:
        """``(lo, hi)`` row ranges of the training mini-batches of one generation batch."""
        train = self.s.per_device_training_batch_size
        for lo in range(0, exp.batch_size, train):
            yield lo, lo + train

    def rollout_metrics(self, batches: Sequence[RolloutBatch], with_values: bool) -> dict[str, float]:
        """Global means of reward, per-token KL, answer length, critic value (``with_values``) and the monitor's."""
        keys = ("reward", "kl", "tokens", "samples", "value")
        local = dict.fromkeys(keys, 0.0)
        extra: dict[str, float] = {}
        for rb in batches:
            for k, v in rollout_stats(rb.exp).items():
                local[k] += v
            if self.monitor is not None:
                for k, v in self.monitor(*self.texts(rb)).items():
                    extra[k] = extra.get(k, 0.0) + v
        names = list(keys) + sorted(extra)
        total = dict(
            zip(names, data_sum(self.roles.actor, [local[k] for k in keys] + [extra[k] for k in sorted(extra)]))
        )
        n, tokens = max(total["samples"], 1.0), max(total["tokens"], 1.0)
        out = {"reward": total["reward"] / n, "kl": total["kl"] / tokens, "answer_len": total["tokens"] / n}
        if with_values:
            out["value"] = total["value"] / tokens
        out.update({k: total[k] / n for k in sorted(extra)})
        return out

    def texts(self, rb: RolloutBatch) -> tuple[list[str], list[str]]:
        """Prompts (as given) and decoded answers (special tokens skipped) of a rollout batch."""
        width = self.s.max_prompt_seq_len
        answers = [
            str(self.tok.decode(row[width:][m[width:].bool()].tolist(), skip_special_tokens=True))
            for row, m in zip(rb.exp.sequences.cpu(), rb.exp.attention_mask.cpu())
        ]
        return [self.prompts[i] for i in rb.prompt_ids], answers


def slice_experience(exp: Experience, lo: int, hi: int) -> Experience:
    """Rows ``lo:hi`` of every field."""
    return Experience(**{f: getattr(exp, f)[lo:hi] for f in Experience.__dataclass_fields__})


def global_scale(engine: Engine, n_local: float) -> float:
    """``n_local * D / N_global`` over the ``D`` data-parallel ranks (see module docstring; the world without
    sequence parallelism); 0 when the global count is 0. Under sequence parallelism the ``s`` ranks of an SP group
    hold the same rows and compute the same loss from whole-row forwards, whose backward gives each rank ``s``
    times its slice's part, so the engine's division by ``W = D s`` leaves the mean over data ranks."""
    sp = engine.sequence_parallel
    (total,) = data_sum(engine, [n_local])
    data_world = engine.comm.world_size // (sp.size if sp is not None else 1)
    return 0.0 if total == 0 else n_local * data_world / total


def step_both(actor: Engine, critic: Engine | None) -> bool:
    """Apply the pending actor and critic steps, or skip both when either overflowed (fp16). Returns skipped."""
    engines = [e for e in (actor, critic) if e is not None]
    boundary = all(e.is_gradient_accumulation_boundary() for e in engines)
    overflow = [e.check_overflow() for e in engines] if boundary else [False] * len(engines)
    for engine, own in zip(engines, overflow):
        if any(overflow) and not own:
            engine.skip_step()
        else:
            engine.step()
    return any(overflow)


def ptx_update(actor: Engine, batch: dict[str, torch.Tensor], coef: float, max_tokens: int | None = None) -> float:
    """DeepSpeed-Chat's unsupervised step: ``coef x`` the LM loss (global token mean) as a separate actor step;
    returns the global mean LM loss (before ``coef``). ``max_tokens`` (``--max_tokens_per_batch``): the batch's
    sequences forwarded and backwarded in packed chunks of at most that many tokens, the same loss
    (:func:`~hybridzero.token_budget.budget_lm_backward`). Under sequence parallelism every rank of an SP group holds
    the same (right-padded) batch; its sequences are packed and each packed row split over the group
    (:func:`~hybridzero.packed_forward.packed_lm_sums`; the backward gives each rank ``s`` times its slice's part,
    which :func:`global_scale`'s data-parallel count expects)."""
    labels = batch["labels"]
    n_tokens = float((labels[:, 1:] != -100).sum())
    scale = coef * global_scale(actor, n_tokens)
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    examples = [(batch["input_ids"][b, :n].tolist(), labels[b, :n].tolist()) for b, n in enumerate(lengths)]
    if max_tokens is not None:
        value = budget_lm_backward(actor, examples, 0, max_tokens, scale=scale)[0]
    elif actor.sequence_parallel is not None:  # one packed forward of the whole batch, split over the SP group
        nll = packed_lm_sums(actor, examples, 0)[0]
        loss = nll / max(n_tokens, 1.0)
        actor.backward(loss * scale)
        value = float(loss.detach())
    else:
        moved = {k: v.to(actor.device) for k, v in batch.items()}
        loss = actor(**moved).loss
        actor.backward(loss * scale)
        value = float(loss.detach())
    step_both(actor, None)
    total, count = data_sum(actor, [value * n_tokens, n_tokens])  # each SP group once
    return total / max(count, 1.0)


def mean_update_stats(
    stats: Sequence[UpdateStats], ptx_losses: Sequence[float] | None, with_critic: bool
) -> dict[str, float]:
    """Means over an iteration's updates (``skipped_steps``: their count); ``ptx_loss`` only with a ptx stream."""
    n = max(len(stats), 1)
    out = {"actor_loss": sum(st.actor_loss for st in stats) / n}
    if with_critic:
        out["critic_loss"] = sum(st.critic_loss for st in stats) / n
    out["clip_fraction"] = sum(st.clip_fraction for st in stats) / n
    out["approx_kl"] = sum(st.approx_kl for st in stats) / n
    if ptx_losses is not None:
        out["ptx_loss"] = sum(ptx_losses) / n
    out["skipped_steps"] = float(sum(st.skipped for st in stats))
    return out
