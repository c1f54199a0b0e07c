"""Typed, frozen settings of the three RLHF steps (and GRPO), with DeepSpeed-Chat's argument names.

Field names are DeepSpeed-Chat's (``per_device_generation_batch_size``, ``generation_batches``, ``ppo_epochs``,
``actor_zero_stage``, ``enable_hybrid_engine``, ``unsup_coef``, ``enable_ema``, …) so its training scripts' flags
map one to one; the command line (:mod:`hybridzero.rlhf.cli`) is generated from these models. Unknown keys are
errors (``extra="forbid"``); every cross-field rule is checked here, before any process group or model exists, and
the error names the key, the value and what would be valid.

Each default and each bound is written once, here: the trainers, the CLI (flags and ``--help``) and the demo read
them from these models. Every float rejects ``inf`` and ``nan`` (``allow_inf_nan=False``): a non-finite
coefficient would train to an all-NaN model. The optimizer and scheduler keys (``*learning_rate``,
``*weight_decay``, ``lr_scheduler_type``, ``num_warmup_steps``, ``gradient_clipping``) are validated only here, by
the types :data:`LearningRate`, :data:`WeightDecay` and :data:`Schedule`; :mod:`hybridzero.rlhf.engines` turns
them into DeepSpeed ``optimizer`` / ``scheduler`` blocks.

Defaults are DeepSpeed-Chat's ``main.py`` defaults of each step (``dtype`` fp16, ``data_path`` Dahoas/rm-static,
``data_split`` 2,4,4, ZeRO stage 0, TensorBoard off, step 1 lr 1e-3, step 2 lr 5e-5, step 3 warmup 100, ...), so a
DeepSpeed-Chat launch script means here what it means there; the demo (:mod:`hybridzero.rlhf.demo.run`) spells out
every value it relies on. ``lr_scheduler_type`` takes DeepSpeed-Chat's six choices with Hugging Face's curves
(``transformers.get_scheduler``: cosine decays to 0); ``warmup_cosine`` is hybridzero's own (DeepSpeed's
``WarmupCosineLR``, decaying to 10%: what the demo was tuned with).

Special values: ``data_path`` entry ``"demo"`` is the dataset that ships with the project
(:mod:`hybridzero.rlhf.data.demo_task`); a DeepSpeed-Chat dataset name (``Dahoas/rm-static``, ...) is read from its
local saved copy under ``data_root`` (:mod:`hybridzero.rlhf.data.dschat`); ``model_name_or_path`` ``"demo"`` builds the
demo's tiny Llama from its config and trains it from scratch (with the demo tokenizer).

One module per step family, imports pointing one way (``common`` < ``supervised``, ``ppo`` < ``grpo``):
:mod:`~hybridzero.rlhf.settings.common` (the value types and the keys every step shares, the LoRA flags),
:mod:`~hybridzero.rlhf.settings.supervised` (steps 1-2), :mod:`~hybridzero.rlhf.settings.ppo` (step 3),
:mod:`~hybridzero.rlhf.settings.grpo` (the GRPO family, its presets and TRL aliases). Each model's own rules stay
with it; this package re-exports every name, so ``from hybridzero.rlhf.settings import ...`` is the one import.
"""

from __future__ import annotations

from hybridzero.rlhf.settings.common import (
    HF_SCHEDULES,
    Dtype,
    Fraction,
    LearningRate,
    Schedule,
    Stage,
    Step3LoRA,
    StepSettings,
    SupervisedLoRA,
    WeightDecay,
)
from hybridzero.rlhf.settings.grpo import ALGORITHM_PRESETS, GRPO_ALIASES, Algorithm, GRPOSettings
from hybridzero.rlhf.settings.ppo import PPOSettings
from hybridzero.rlhf.settings.supervised import RewardSettings, SFTSettings, SupervisedSettings

__all__ = [
    "ALGORITHM_PRESETS",
    "GRPO_ALIASES",
    "HF_SCHEDULES",
    "Algorithm",
    "Dtype",
    "Fraction",
    "GRPOSettings",
    "LearningRate",
    "PPOSettings",
    "RewardSettings",
    "SFTSettings",
    "Schedule",
    "Stage",
    "Step3LoRA",
    "StepSettings",
    "SupervisedLoRA",
    "SupervisedSettings",
    "WeightDecay",
]
