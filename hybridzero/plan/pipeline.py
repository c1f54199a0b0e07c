"""RLHF's four models in one plan (DeepSpeed-Chat step 3): actor and critic trained, reference and reward only
inferring, the actor generating with the hybrid engine.

Per PPO step (one experience batch of ``micro`` prompts per rank): the actor generates ``answer`` tokens after
``prompt`` tokens on gathered parameters; the actor, reference, critic and reward models each run one inference
forward over the ``prompt + answer`` sequence; then the actor and the critic train one step each (``ppo_epochs``
times). All four models' states are resident at once, so the device must hold their sum plus the largest transient
(the actor's generation: whole gathered model and KV cache; or a training step's gathered buffers and activations).
When the whole gathered actor does not fit beside the resident states, generation runs on the per-forward ZeRO-3 path
(``runtime/hybrid.py`` with a ``max_gathered_bytes`` budget): every decoded token gathers the model again.
The critic and reward model are the causal LM of their config (DeepSpeed-Chat's value head replaces the LM head:
the plan overestimates them by the head's ``vocab x hidden`` parameters, stated in docs/plan.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import transformers

from hybridzero.plan.model import LoRAPlan, meta_model
from hybridzero.plan.planner import HEADROOM, Cluster, Workload, plan_model

__all__ = ["RLHFShape", "plan_rlhf"]


@dataclass(frozen=True)
class RLHFShape:
    """The four models (HF configs) and the sequence lengths of one PPO step."""

    actor: transformers.PretrainedConfig
    critic: transformers.PretrainedConfig
    reference: transformers.PretrainedConfig
    reward: transformers.PretrainedConfig
    prompt: int = 256
    answer: int = 256
    ppo_epochs: int = 1
    checkpointing: bool = True


def plan_rlhf(shape: RLHFShape, raw: dict[str, Any], cluster: Cluster, lora: LoRAPlan | None = None) -> dict[str, Any]:
    """Plans of the four models and the PPO step's totals (see module docstring)."""
    seq = shape.prompt + shape.answer
    train = Workload(seq, shape.checkpointing)
    infer = Workload(seq, train=False)
    actor, critic = meta_model(shape.actor, lora=lora), meta_model(shape.critic, lora=lora)
    plans = {
        "actor": plan_model(
            actor, shape.actor, raw, cluster, Workload(seq, shape.checkpointing, generate=(shape.prompt, shape.answer))
        ),
        "critic": plan_model(critic, shape.critic, raw, cluster, train),
        "reference": plan_model(meta_model(shape.reference, frozen=True), shape.reference, raw, cluster, infer),
        "reward": plan_model(meta_model(shape.reward, frozen=True), shape.reward, raw, cluster, infer),
    }
    actor_infer = plan_model(actor, shape.actor, raw, cluster, infer)
    experience = [
        plans["reference"],
        plans["reward"],
        actor_infer,
        plan_model(critic, shape.critic, raw, cluster, infer),
    ]
    resident = sum(_resident(p) for p in plans.values())
    budget = HEADROOM * cluster.device.memory_bytes
    act_key = "checkpointing" if shape.checkpointing else "no_checkpointing"
    training = max(p["memory"]["gathered_peak"] + p["memory"]["activations"][act_key] for p in plans.values())
    gen = plans["actor"]["generation"]
    full = gen["gathered_bytes"] + gen["kv_cache_bytes"]
    tp = gen["tensor_parallel"]
    if resident + max(training, full) <= budget or tp is not None:  # TP generation has no per-forward fallback
        mode, transient = ("full" if tp is None else f"tensor-parallel x{tp['size']}"), max(training, full)
        generation_s = gen["gather_s"] + gen["decode_s"]
    else:  # runtime/hybrid.py: over the max_gathered_bytes budget, per-forward ZeRO-3 generation (HF synced gpus)
        mode = "per-forward ZeRO-3"
        transient = max(training, actor_infer["memory"]["gathered_peak"] + gen["kv_cache_bytes"])
        generation_s = shape.answer * actor_infer["step_time"]["exposed_comm_s"] + gen["decode_s"]
    inference_s = sum(p["step_time"]["total_s"] for p in experience)
    train_s = shape.ppo_epochs * (plans["actor"]["step_time"]["total_s"] + plans["critic"]["step_time"]["total_s"])
    total = resident + transient
    return {
        "models": plans,
        "generation_mode": mode,
        "max_gathered_bytes": None if tp is not None else int(budget - resident - gen["kv_cache_bytes"]),
        "device_resident_bytes": resident,
        "device_transient_bytes": transient,
        "device_total": total,
        "fits": total <= budget,
        "ppo_step_s": {
            "generation": generation_s,
            "experience": inference_s,
            "training": train_s,
            "total": generation_s + inference_s + train_s,
        },
    }


def _resident(plan: dict[str, Any]) -> int:
    """Device bytes a model holds between its uses (model states placed on the device)."""
    return sum(int(v) for v in plan["memory"]["placement"]["device"].values())
