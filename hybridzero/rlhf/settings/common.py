"""What every RLHF step's settings share: the value types (each bound written once), the frozen model config, the
keys of every step (:class:`StepSettings`) and DeepSpeed-Chat's LoRA flags (:class:`SupervisedLoRA`,
:class:`Step3LoRA`). The bottom of :mod:`hybridzero.rlhf.settings`: imports nothing of hybridzero."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Dtype = Literal["fp32", "bf16", "fp16"]
HF_SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")
Schedule = Literal[
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "warmup_cosine"
]
Stage = Literal[0, 1, 2, 3]
LearningRate = Annotated[float, Field(gt=0.0)]
WeightDecay = Annotated[float, Field(ge=0.0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
CONFIG = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class StepSettings(BaseModel):
    """Keys every step shares."""

    model_config = CONFIG

    data_path: list[str] = Field(default_factory=lambda: ["Dahoas/rm-static"], min_length=1)
    data_split: str = "2,4,4"
    data_root: str | None = Field(
        None,
        description="folder holding local copies of DeepSpeed-Chat's datasets "
        "(DATA_ROOT/Dahoas/rm-static, ...); default: $HYBRIDZERO_DATA_ROOT",
    )
    output_dir: str = "runs/step"
    seed: int = 1234
    dtype: Dtype = "fp16"
    num_train_epochs: int = Field(1, ge=1)
    lr_scheduler_type: Schedule = "cosine"
    num_warmup_steps: int = Field(0, ge=0)
    gradient_clipping: float = Field(1.0, ge=0.0)
    enable_tensorboard: bool = False
    print_every: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps (all epochs)")
    gradient_accumulation_steps: int = Field(1, ge=1)
    progress: bool = True
    packing_samples: bool = Field(
        False,
        description="training forwards on packed rows (sequences concatenated, block-causal attention, positions "
        "restarting per sequence): no padding, same per-sample results (README 'Sample packing')",
    )
    max_tokens_per_batch: int | None = Field(
        None,
        ge=1,
        description="with packing_samples: forward/backward each micro-batch (SFT) or training mini-batch (RL) in "
        "packed chunks of at most this many tokens; same loss (README 'Sample packing')",
    )

    @model_validator(mode="after")
    def _token_budget_needs_packing(self) -> StepSettings:
        if self.max_tokens_per_batch is not None and not self.packing_samples:
            raise ValueError(
                f"max_tokens_per_batch={self.max_tokens_per_batch} needs packing_samples=true "
                "(set --packing_samples or drop --max_tokens_per_batch)"
            )
        return self


# --- DeepSpeed-Chat's LoRA flags (hybridzero.rlhf.lora reads them; defaults are DS-Chat's main.py) --------------
class SupervisedLoRA(BaseModel):
    """Steps 1-2: ``--lora_dim`` (0: off), ``--lora_module_name`` (substring of module names),
    ``--only_optimize_lora``, ``--lora_learning_rate``."""

    model_config = CONFIG

    lora_dim: int = Field(0, ge=0)
    lora_module_name: str = "decoder.layers."
    only_optimize_lora: bool = False
    lora_learning_rate: LearningRate = 5e-4


class Step3LoRA(BaseModel):
    """Step 3: actor / critic LoRA, ``--only_optimize_lora`` for both, ``--enable_mixed_precision_lora`` (actor)."""

    model_config = CONFIG

    actor_lora_dim: int = Field(0, ge=0)
    actor_lora_module_name: str = "decoder.layers."
    critic_lora_dim: int = Field(0, ge=0)
    critic_lora_module_name: str = "decoder.layers."
    only_optimize_lora: bool = False
    actor_lora_learning_rate: LearningRate = 5e-4
    critic_lora_learning_rate: LearningRate = 5e-4
    enable_mixed_precision_lora: bool = False
