"""When GRPO's "old" log-probs need a pass of their own, and when the update forward's own are exact.

The clipped GRPO loss reads ``w = exp(logp - old)``, ``old`` being the log-probs of the policy that sampled the
batch. Step 3 records them at rollout with a no-grad forward of the actor over every sample. That forward is
redundant when the update forward of every mini-batch runs on exactly the weights that sampled it: then ``old`` *is*
``logp.detach()`` (``w = 1`` in value, ``dw = dlogp``), which is what TRL's GRPOTrainer uses in that case. Skipping
the pass saves one actor forward over the whole batch an iteration (a third to a half of GRPO's training forwards
without a reference model). The weights that sampled a mini-batch are the ones its update forward sees iff no
optimizer step is applied between the rollout and that forward, and the forward computes the same function as the
rollout's eval-mode pass. :func:`old_logprobs_from_update` decides it from the settings and the actor's state before
the iteration's rollout:

* ``old_logprobs = "auto"`` (``"rollout_pass"`` forces the pass);
* one pass over the iteration's samples (``ppo_epochs`` / TRL's ``num_iterations`` = 1);
* the iteration's training mini-batches (``updates_per_iteration``) are exactly one optimizer step: as many as
  ``gradient_accumulation_steps``, with the actor's micro-step counter at the start of an accumulation (so the
  step boundary falls on the iteration's last mini-batch, never before);
* no ptx step between mini-batches (ptx off, or a single mini-batch: its ptx step follows the only forward);
* no truncated importance-sampling correction (its weights read the old log-probs at rollout);
* no dropout in the actor (a train-mode forward with dropout is not the rollout's eval-mode function).

Invariant (checked where the loss is built, :func:`check_on_policy`): a batch scored without the pass records the
actor's ``global_steps`` at rollout; its update forwards run only while the actor still has that step count.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridzero.rlhf.settings import GRPOSettings, PPOSettings

__all__ = ["check_on_policy", "has_dropout", "old_logprobs_from_update"]


def has_dropout(module: torch.nn.Module) -> bool:
    """Whether a train-mode forward of ``module`` may drop activations: an ``nn.Dropout`` with ``p > 0``, or a
    positive ``*dropout*`` / ``*pdrop*`` entry in its HF config (attention dropout is functional, no module)."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules()):
        return True
    config: Any = getattr(module, "config", None)
    entries = config.to_dict() if config is not None and hasattr(config, "to_dict") else {}
    return any(
        ("dropout" in key or "pdrop" in key) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
        for key, v in entries.items()
    )


def old_logprobs_from_update(
    s: PPOSettings, updates_per_iteration: int, micro_steps: int, *, dropout: bool, ptx: bool
) -> bool:
    """True when this iteration's old log-probs may be the update forward's own, detached (module docstring): the
    rollout then skips the actor's log-prob pass. ``micro_steps``: the actor's micro-step counter now, before the
    iteration's rollout."""
    if not isinstance(s, GRPOSettings) or s.old_logprobs != "auto":
        return False
    accum = s.gradient_accumulation_steps
    return (
        s.ppo_epochs == 1
        and updates_per_iteration == accum
        and micro_steps % accum == 0
        and (not ptx or updates_per_iteration == 1)
        and not s.vllm_importance_sampling_correction
        and not dropout
    )


def check_on_policy(policy_step: int | None, global_steps: int) -> None:
    """Raise if a batch scored without the old log-prob pass (``policy_step``: the actor's ``global_steps`` at its
    rollout) reaches an update forward after the actor stepped: its old log-probs would then be wrong."""
    if policy_step is not None and policy_step != global_steps:
        raise RuntimeError(
            f"GRPO: a batch sampled at actor step {policy_step} was scored without old log-probs but is updated at "
            f"step {global_steps}; set old_logprobs = 'rollout_pass' and report this"
        )
