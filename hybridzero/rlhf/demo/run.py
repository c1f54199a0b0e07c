"""The embedded demo: SFT -> reward model -> PPO on the shipped "reverse the digits" task, then a verdict.

The tiny Llama is trained from scratch in step 1 on demonstrations of mixed quality (half correct reversals, half
a copying habit); the reward model learns from preference pairs; PPO optimizes the reward model's score. Nothing
in training sees :func:`hybridzero.rlhf.data.demo_task.rule_score`, the hidden rule (exact reversal). The verdict
evaluates the SFT and the PPO policies on held-out prompts (``eval_prompts.jsonl``): the rule's exact-match rate
(greedy and sampled), the copy rate and the reward model's mean score, so reward hacking (reward up, rule flat or
down) would show. Writes ``summary.json`` and PNG plots, and prints where everything is.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridzero.rlhf.data.demo_task import demo_data_dir, rule_is_copy, rule_partial, rule_score, rule_scores
from hybridzero.rlhf.data.records import load_records
from hybridzero.rlhf.demo.arith_run import rollout_engine_settings
from hybridzero.rlhf.demo.report import held_out_answers, write_report
from hybridzero.rlhf.engines import build_engine, ds_config, global_sum, load_actor_engine, world_comm
from hybridzero.rlhf.models import last_token_index, load_tokenizer, load_value_model
from hybridzero.rlhf.runlog.metrics import echo_fn
from hybridzero.rlhf.settings import PPOSettings, RewardSettings, SFTSettings
from hybridzero.rlhf.steps.reward_model import train_reward
from hybridzero.rlhf.steps.rl.step3 import Monitor
from hybridzero.rlhf.steps.rl.trainer import train_step3
from hybridzero.rlhf.steps.sft import train_sft

__all__ = ["demo_monitor", "demo_settings", "evaluate_policy", "run_demo"]


def demo_monitor() -> Monitor:
    """Per-sample sums of the hidden demo rule (logged only; the policy never sees it)."""

    def monitor(prompts: list[str], answers: list[str]) -> dict[str, float]:
        scores = rule_scores(prompts, answers)
        return {"rule_score": scores["exact"] * len(prompts), "copy_rate": scores["copy"] * len(prompts)}

    return monitor


def demo_settings(
    out: Path, quick: bool = False, world: int = 2, rollout_engine: str = "hf"
) -> tuple[SFTSettings, RewardSettings, PPOSettings]:
    """The three steps' settings (``quick``: a few steps each, for smoke tests). Global batches are 64 sequences
    (per-device sizes = 64 / world), so any world size that divides 64 trains on the same batches. PPO's rollouts
    come from ``rollout_engine`` (``hf`` or ``vllm``).

    Chosen by measurement (``bench/demo_task_probe.py`` and full runs at world 2): ~1800 SFT steps with a decaying
    lr make nearly every sampled answer a correct reversal or a correct copy (the demonstrations' 50/50 mixture);
    8 reward-model epochs give ~0.94 held-out pairwise accuracy; 10 PPO epochs over the 768 prompts (120 iterations)
    move the policy from the mixture to the reversal.
    """
    per = 64 // world
    # what the demo was tuned with, spelled out (the settings' defaults are DeepSpeed-Chat's, which differ)
    own: dict[str, Any] = {
        "data_path": ["demo"],
        "dtype": "fp32",
        "enable_tensorboard": True,
        "lr_scheduler_type": "warmup_cosine",
    }
    stages = {"actor_zero_stage": 3, "critic_zero_stage": 3, "reference_zero_stage": 3, "reward_zero_stage": 3}
    sft = SFTSettings(
        **own,
        zero_stage=3,
        output_dir=str(out / "step1_sft"),
        per_device_train_batch_size=per,
        max_seq_len=24,
        learning_rate=3e-3,
        num_train_epochs=30,
        num_warmup_steps=20,
        max_steps=12 if quick else None,
        print_every=100,
        seed=1,
    )
    reward = RewardSettings(
        **own,
        zero_stage=3,
        output_dir=str(out / "step2_reward"),
        model_name_or_path=sft.output_dir,
        per_device_train_batch_size=per,
        max_seq_len=24,
        learning_rate=1e-3,
        num_train_epochs=8,
        num_warmup_steps=10,
        eval_fraction=0.1,
        max_steps=6 if quick else None,
        print_every=50,
        seed=2,
    )
    ppo = PPOSettings(
        **own,
        **stages,
        **rollout_engine_settings(rollout_engine),
        output_dir=str(out / "step3_ppo"),
        actor_model_name_or_path=sft.output_dir,
        critic_model_name_or_path=reward.output_dir,
        per_device_generation_batch_size=per,
        per_device_training_batch_size=per // 2,
        generation_batches=1,
        ppo_epochs=1,
        max_prompt_seq_len=8,
        max_answer_seq_len=8,
        actor_learning_rate=1e-4,
        critic_learning_rate=3e-4,
        num_warmup_steps=5,
        kl_ctl=0.05,
        num_train_epochs=10,
        max_steps=2 if quick else None,
        enable_ema=True,
        ema_beta=0.95,
        enable_hybrid_engine=True,
        monitor="demo",
        print_every=10,
        save_interval=40,
        seed=3,
        resume=False,
    )
    return sft, reward, ppo


def _eval_prompts() -> list[str]:
    return [r["prompt"] for r in load_records(demo_data_dir() / "eval_prompts.jsonl", ("prompt",))]


def evaluate_policy(
    actor_dir: str,
    reward_dir: str,
    prompts: list[str],
    *,
    do_sample: bool,
    seed: int = 99,
    prompt_width: int = 8,
    answer_len: int = 8,
) -> dict[str, float]:
    """Hidden-rule and reward-model scores of the policy in ``actor_dir`` on ``prompts`` (dealt over ranks)."""
    comm = world_comm()
    world, rank = comm.world_size, comm.rank
    tok = load_tokenizer(actor_dir)
    cfg = ds_config(stage=3, dtype="fp32", micro_batch=1, world_size=world)
    actor = load_actor_engine(actor_dir, cfg, False)
    reward = build_engine(
        load_value_model(reward_dir).float(), ds_config(stage=3, dtype="fp32", micro_batch=1, world_size=world)
    )
    mine, ro, answers = held_out_answers(
        actor,
        tok,
        prompts,
        rank=rank,
        world=world,
        seed=seed,
        prompt_width=prompt_width,
        answer_len=answer_len,
        do_sample=do_sample,
    )
    with torch.no_grad():
        values = reward(input_ids=ro.sequences, attention_mask=ro.attention_mask)
        scores = values.gather(1, last_token_index(ro.attention_mask)[:, None]).squeeze(1)
    sums = [
        sum(float(rule_score(prompts[i], a)) for i, a in zip(mine, answers)),
        sum(float(rule_partial(prompts[i], a)) for i, a in zip(mine, answers)),
        sum(float(rule_is_copy(prompts[i], a)) for i, a in zip(mine, answers)),
        float(scores.sum()),
        float(len(mine)),
    ]
    total = global_sum(actor, sums)
    n = max(total[4], 1.0)
    return {"rule_exact": total[0] / n, "rule_partial": total[1] / n, "copy_rate": total[2] / n, "reward": total[3] / n}


def _verdict(results: dict[str, dict[str, float]], echo: Callable[[str], None]) -> None:
    """Print the evaluation table and the margin the demo claims."""
    echo("policy evaluation on held-out prompts (hidden rule = exact reversal; the models never saw it):")
    echo(f"{'policy':<18}{'rule exact':>11}{'rule partial':>13}{'copy rate':>10}{'RM reward':>10}")
    for name, r in results.items():
        echo(f"{name:<18}{r['rule_exact']:>11.3f}{r['rule_partial']:>13.3f}{r['copy_rate']:>10.3f}{r['reward']:>10.3f}")
    sft, ppo = results["sft (sampled)"], results["ppo (sampled)"]
    echo(
        f"PPO - SFT, sampled: rule exact {ppo['rule_exact'] - sft['rule_exact']:+.3f}, "
        f"RM reward {ppo['reward'] - sft['reward']:+.3f}"
    )


def run_demo(out_dir: str = "runs/demo", quick: bool = False, rollout_engine: str = "hf") -> dict[str, Any]:
    """All three steps and the verdict on the current process group, PPO's rollouts from ``rollout_engine``;
    returns the summary (every rank)."""
    comm = world_comm()
    world, rank = comm.world_size, comm.rank
    out = Path(out_dir)
    sft_s, reward_s, ppo_s = demo_settings(out, quick, world, rollout_engine)
    echo = echo_fn(False) if rank == 0 else (lambda line: None)
    sft_m = train_sft(sft_s)
    reward_m = train_reward(reward_s)
    ppo_m = train_step3(ppo_s, monitor=demo_monitor())
    prompts = _eval_prompts()
    results = {}
    for name, path in (
        ("sft", sft_s.output_dir),
        ("ppo", ppo_m["models"]["actor"]),
        ("ppo ema", ppo_m["models"].get("actor_ema")),
    ):
        for sampled in (False, True):
            if path is not None:
                label = f"{name} ({'sampled' if sampled else 'greedy'})"
                results[label] = evaluate_policy(path, reward_s.output_dir, prompts, do_sample=sampled)
    summary = {
        "world_size": world,
        "rollout_engine": ppo_s.rollout_engine,
        "vllm_syncs": ppo_m["vllm_syncs"],
        "sft": sft_m,
        "reward": reward_m,
        "ppo_last": ppo_m["history"][-1],
        "evaluation": results,
        "models": {"sft": sft_s.output_dir, "reward": reward_s.output_dir, **ppo_m["models"]},
    }
    if rank == 0:
        plots = write_report(out, (sft_s.output_dir, reward_s.output_dir, ppo_s.output_dir), summary, echo)
        _verdict(results, echo)
        echo(f"reward model held-out accuracy: {reward_m['eval_accuracy']:.3f}")
        echo(f"plots: {out}/step*/plots/ ({len(plots)} PNG files); summary: {out / 'summary.json'}")
        echo(
            f"final models: actor {ppo_m['models']['actor']}, EMA actor {ppo_m['models'].get('actor_ema')}, "
            f"critic {ppo_m['models'].get('critic')}, reward model {reward_s.output_dir}"
        )
    return summary
