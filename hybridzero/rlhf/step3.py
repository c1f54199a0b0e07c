"""Step 3: the PPO / GRPO loop (DeepSpeed-Chat's ``main.py`` of step 3, with its failure classes designed out).

One **iteration**: for each of ``generation_batches`` batches, roll out (hybrid-engine ``generate`` or plain ZeRO-3
generation), score the experience; then ``ppo_epochs`` passes over all of it in mini-batches of
``per_device_training_batch_size`` (PPO: actor and critic steps, skipped together on an fp16 overflow; GRPO: actor
steps), each followed by an unsupervised (ptx) actor step when a ptx dataset is given; then the EMA actor moves.
Metrics are global means, logged per iteration (``metrics.jsonl``, TensorBoard, a DeepSpeed-Chat-style report).

Checkpoints of the trained roles (actor, critic, EMA) go to ``output_dir/checkpoints/<role>`` every
``save_interval`` iterations and at the end; a run started with ``resume`` continues from the latest one — sampling
depends only on sample ids and data orders only on seeds, so the resumed run continues the same curve. Final models:
``output_dir/actor`` (HF directory), ``output_dir/critic`` (value model), ``output_dir/actor_ema``.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridzero.rlhf.common import epoch_order, global_sum, open_runlog
from hybridzero.rlhf.data import pad_token_id
from hybridzero.rlhf.engines import ema_update
from hybridzero.rlhf.experience import Experience
from hybridzero.rlhf.models import save_causal_lm, save_value_model
from hybridzero.rlhf.ppo import (
    Roles,
    Targets,
    compute_targets,
    grpo_targets,
    grpo_update,
    make_experience,
    ppo_update,
    ptx_update,
    rollout_stats,
)
from hybridzero.rlhf.ptx import PtxStream
from hybridzero.rlhf.sampling import rollout
from hybridzero.rlhf.settings import GRPOSettings, PPOSettings
from hybridzero.rlhf.step3_report import Reporter
from hybridzero.rlhf.step3_setup import (
    Plan,
    build_roles,
    load_prompts,
    make_plan,
    model_context,
    prompt_tensors,
    rank_prompts,
)

__all__ = ["Monitor", "train_step3"]

Monitor = Callable[[list[str], list[str]], dict[str, float]]  # (prompts, answers) -> per-sample sums
_ROLES = ("actor", "critic", "ema")


def _slice(exp: Experience, lo: int, hi: int) -> Experience:
    return Experience(**{f: getattr(exp, f)[lo:hi] for f in Experience.__dataclass_fields__})


def _generate_fn(roles: Roles, hybrid: bool) -> Callable[..., torch.Tensor]:
    return roles.actor.generate if hybrid else roles.actor.module.generate


class Step3:
    """State of one step-3 run on this rank (engines, prompts, plan, logs)."""

    def __init__(self, s: PPOSettings, monitor: Monitor | None) -> None:
        import hybridzero

        hybridzero.init_distributed()
        self.s, self.monitor = s, monitor
        self.grpo = isinstance(s, GRPOSettings)
        self.world = torch.distributed.get_world_size()
        self.rank = torch.distributed.get_rank()
        import transformers

        from hybridzero.rlhf.engines import load_tokenizer

        self.tok = load_tokenizer(s.actor_model_name_or_path)
        self.hf_config = transformers.AutoConfig.from_pretrained(s.actor_model_name_or_path)
        self.prompts, counts = load_prompts(s, self.tok, model_context(self.hf_config))
        self.plan: Plan = make_plan(s, self.world, len(self.prompts))
        self.roles = build_roles(s, self.world, self.plan.total_iterations)
        self.pad_id = pad_token_id(self.tok, pad_to_eos=True)
        self.eos_id = self.tok.eos_token_id
        self.ptx = PtxStream(s, self.tok, self.pad_id, self.rank, self.world) if s.unsupervised_dataset_name else None
        self.log = open_runlog(s.output_dir, self.rank, s.enable_tensorboard, s.progress)
        self.report = Reporter(self, self.log)
        self.log.print(f"{'GRPO' if self.grpo else 'PPO'}: {len(self.prompts)} prompts (prompt filter {counts}), "
                       f"{self.plan.total_iterations} iterations at world {self.world}, hybrid engine "
                       f"{'on' if s.enable_hybrid_engine else 'off'}")
        self.start = self._resume() if s.resume else 0
        if self.ptx is not None:  # the ptx stream is a function of batches drawn: re-position it
            self.ptx.skip(self.start * s.ppo_epochs * s.generation_batches
                          * (s.per_device_generation_batch_size // s.per_device_training_batch_size))

    # --- one iteration ------------------------------------------------------------------------------------------
    def _rollout(self, it: int, batch: int) -> tuple[Experience, list[int]]:
        """Generate and score generation batch ``batch`` of iteration ``it`` (this rank's share)."""
        plan, s = self.plan, self.s
        epoch, pos = divmod(it, plan.iterations_per_epoch)
        order = epoch_order(plan.n_prompts, s.seed, epoch)
        positions = rank_prompts(order, plan, pos, batch, self.rank)
        prompt_ids = [order[q] for q in positions for _ in range(plan.k)]
        sample_ids = [(epoch * plan.n_prompts + q) * plan.k + j for q in positions for j in range(plan.k)]
        ids, mask = prompt_tensors(self.tok, [self.prompts[i] for i in prompt_ids], self.pad_id)
        device = self.roles.actor.device
        ro = rollout(_generate_fn(self.roles, s.enable_hybrid_engine), ids.to(device), mask.to(device),
                     sample_ids=sample_ids, run_seed=s.seed, prompt_width=s.max_prompt_seq_len,
                     answer_len=s.max_answer_seq_len, pad_id=self.pad_id, eos_id=self.eos_id,
                     do_sample=s.do_sample, temperature=s.temperature, top_k=s.top_k)
        return make_experience(self.roles, ro), prompt_ids

    def _targets(self, exp: Experience) -> Targets:
        if self.grpo:
            assert isinstance(self.s, GRPOSettings)
            return Targets(advantages=grpo_targets(exp, self.s.group_size), returns=None)
        s = self.s
        return compute_targets(exp, kl_coef=s.kl_ctl, clip_reward=s.clip_reward_value, gamma=s.gamma, lam=s.lambd)

    def _train(self, batches: list[tuple[Experience, Targets]]) -> dict[str, float]:
        """``ppo_epochs`` passes over the iteration's experience in training mini-batches."""
        s, train = self.s, self.s.per_device_training_batch_size
        sums = {"actor_loss": 0.0, "critic_loss": 0.0, "clip_fraction": 0.0, "approx_kl": 0.0, "ptx_loss": 0.0,
                "skipped": 0.0, "updates": 0.0}
        for _ in range(s.ppo_epochs):
            for exp, targets in batches:
                for lo in range(0, exp.batch_size, train):
                    mini = _slice(exp, lo, lo + train)
                    adv = targets.advantages[lo:lo + train]
                    if self.grpo:
                        assert isinstance(s, GRPOSettings)
                        st = grpo_update(self.roles, mini, adv, clip=s.cliprange, kl_coef=s.grpo_kl_coef)
                    else:
                        assert targets.returns is not None
                        st = ppo_update(self.roles, mini, Targets(adv, targets.returns[lo:lo + train]),
                                        clip=s.cliprange, clip_value=s.cliprange_value)
                    for key in ("actor_loss", "critic_loss", "clip_fraction", "approx_kl"):
                        sums[key] += getattr(st, key)
                    sums["skipped"] += float(st.skipped)
                    sums["updates"] += 1
                    if self.ptx is not None:
                        sums["ptx_loss"] += ptx_update(self.roles.actor, self.ptx.next_batch(), s.unsup_coef)
        n = max(sums.pop("updates"), 1.0)
        out = {k: v / n for k, v in sums.items() if k != "skipped"}
        out["skipped_steps"] = sums["skipped"]
        if self.ptx is None:
            out.pop("ptx_loss")
        if self.grpo:
            out.pop("critic_loss")
        return out

    def iteration(self, it: int) -> dict[str, float]:
        """Roll out, train, move the EMA; returns the iteration's global metrics."""
        t0 = time.perf_counter()
        batches, rollouts, gen_s = [], [], 0.0
        for b in range(self.s.generation_batches):
            g0 = time.perf_counter()
            exp, prompt_ids = self._rollout(it, b)
            gen_s += time.perf_counter() - g0
            batches.append((exp, self._targets(exp)))
            rollouts.append((exp, prompt_ids))
        t1 = time.perf_counter()
        metrics = self._train(batches)
        train_s = time.perf_counter() - t1
        if self.roles.ema is not None:
            ema_update(self.roles.ema, self.roles.actor, self.s.ema_beta)
        metrics.update(self._rollout_metrics(rollouts))
        timing = {"e2e_s": time.perf_counter() - t0, "generation_s": gen_s, "training_s": train_s}
        return {**metrics, **timing, "actor_lr": self.roles.actor.get_lr()[0]}

    def _rollout_metrics(self, rollouts: list[tuple[Experience, list[int]]]) -> dict[str, float]:
        """Global means of reward, per-token KL, answer length (and the monitor's numbers)."""
        keys = ("reward", "kl", "tokens", "samples", "value")
        local = dict.fromkeys(keys, 0.0)
        extra: dict[str, float] = {}
        for exp, prompt_ids in rollouts:
            for k, v in rollout_stats(exp).items():
                local[k] += v
            if self.monitor is not None:
                for k, v in self.monitor(*self._texts(exp, prompt_ids)).items():
                    extra[k] = extra.get(k, 0.0) + v
        names = list(keys) + sorted(extra)
        total = dict(zip(names, global_sum(self.roles.actor, [local[k] for k in keys] +
                                           [extra[k] for k in sorted(extra)])))
        n, tokens = max(total["samples"], 1.0), max(total["tokens"], 1.0)
        out = {"reward": total["reward"] / n, "kl": total["kl"] / tokens, "answer_len": total["tokens"] / n}
        if not self.grpo:
            out["value"] = total["value"] / tokens
        out.update({k: total[k] / n for k in sorted(extra)})
        return out

    def _texts(self, exp: Experience, prompt_ids: list[int]) -> tuple[list[str], list[str]]:
        """Prompts (as given) and decoded answers (special tokens skipped) of a rollout."""
        width = self.s.max_prompt_seq_len
        answers = [self.tok.decode(row[width:][m[width:].bool()].tolist(), skip_special_tokens=True)
                   for row, m in zip(exp.sequences.cpu(), exp.attention_mask.cpu())]
        return [self.prompts[i] for i in prompt_ids], answers

    # --- checkpoints --------------------------------------------------------------------------------------------
    def _engines(self) -> dict[str, Any]:
        return {name: getattr(self.roles, name) for name in _ROLES if getattr(self.roles, name) is not None}

    def save(self, iteration: int) -> None:
        """Checkpoint the trained roles (every rank calls; atomic per engine)."""
        root = Path(self.s.output_dir) / "checkpoints"
        for name, engine in self._engines().items():
            engine.save_checkpoint(str(root / name), tag=f"iter{iteration}", client_state={"iteration": iteration})

    def _resume(self) -> int:
        """Load the latest checkpoint of every trained role when one exists; returns the iteration to start at."""
        root = Path(self.s.output_dir) / "checkpoints"
        if not (root / "actor" / "latest").is_file():
            return 0
        done = set()
        for name, engine in self._engines().items():
            _, client = engine.load_checkpoint(str(root / name))
            done.add(int(client["iteration"]))
        if len(done) != 1:
            raise ValueError(f"{root}: the roles' latest checkpoints disagree on the iteration ({sorted(done)})")
        start = done.pop()
        self.log.print(f"resumed from {root} at iteration {start}")
        return start

    def finish(self) -> dict[str, str]:
        """Write the final models; returns their directories."""
        out = Path(self.s.output_dir)
        paths = {"actor": save_causal_lm(self.roles.actor, out / "actor", self.hf_config, self.tok)}
        if self.roles.critic is not None:
            paths["critic"] = save_value_model(self.roles.critic, out / "critic", self.tok)
        if self.roles.ema is not None:
            paths["actor_ema"] = save_causal_lm(self.roles.ema, out / "actor_ema", self.hf_config, self.tok)
        return {k: str(v) for k, v in paths.items()}


def train_step3(s: PPOSettings, monitor: Monitor | None = None) -> dict[str, Any]:
    """Run step 3 (PPO, or GRPO for :class:`GRPOSettings`); returns ``{"history": [...], "models": {...}}``."""
    from tqdm import tqdm

    run = Step3(s, monitor)
    history: list[dict[str, float]] = []
    total = run.plan.total_iterations
    bar = tqdm(total=total, initial=run.start, desc="grpo" if run.grpo else "ppo",
               disable=not (s.progress and run.rank == 0))
    for it in range(run.start, total):
        metrics = run.iteration(it)
        history.append(metrics)
        run.report.step(it + 1, total, metrics)
        if (s.save_interval and (it + 1) % s.save_interval == 0) or it + 1 == total:
            run.save(it + 1)
        bar.update(1)
    bar.close()
    models = run.finish()
    run.log.print(f"{'GRPO' if run.grpo else 'PPO'}: final actor in {models['actor']}")
    run.log.close()
    return {"history": history, "models": models, "start": run.start}
