"""Steps 1 and 2 (SFT, reward model): the keys both share (:class:`SupervisedSettings`) and each one's own."""

from __future__ import annotations

from pydantic import Field, model_validator

from hybridzero.rlhf.settings.common import LearningRate, Stage, StepSettings, SupervisedLoRA, WeightDecay


class SupervisedSettings(StepSettings, SupervisedLoRA):
    """SFT and reward-model keys."""

    model_name_or_path: str = "demo"
    per_device_train_batch_size: int = Field(16, ge=1)
    per_device_eval_batch_size: int = Field(16, ge=1)
    max_seq_len: int = Field(512, ge=2)
    learning_rate: LearningRate = 1e-3
    weight_decay: WeightDecay = 0.0
    zero_stage: Stage = 0
    gradient_checkpointing: bool = False
    eval_fraction: float = Field(0.05, gt=0.0, lt=1.0)
    eval_interval: int = Field(0, ge=0, description="evaluate every N steps (0: at the end of each epoch only)")
    add_eot_token: bool = Field(
        False, description="--eot_token becomes one special token ending every answer (the tokenizer's eos)"
    )
    eot_token: str = Field("<|endoftext|>", description="DeepSpeed-Chat's end-of-turn token (with --add_eot_token)")
    dropout: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description="DeepSpeed-Chat's --dropout: the model config's dropout, attention_dropout, hidden_dropout and "
        "activation_dropout (those it has) during training; default: the model's own (--disable_dropout: 0)",
    )
    offload: bool = Field(
        False,
        description="ZeRO-Offload (DeepSpeed-Chat's --offload): fp32 master, gradients and Adam state on the host, "
        "and at stage 3 the parameter shards too; needs zero_stage >= 1",
    )

    @model_validator(mode="after")
    def _check_offload(self) -> SupervisedSettings:
        """``offload`` moves the optimizer's shard, which only a ZeRO stage has (DeepSpeed-Chat at stage 0 would
        hand DeepSpeedCPUAdam device parameters)."""
        if self.offload and self.zero_stage == 0:
            raise ValueError(
                "offload = True needs zero_stage 1, 2 or 3 (ZeRO-Offload moves the optimizer's shard to the host), "
                "got zero_stage = 0; pass --zero_stage 1, 2 or 3, or drop --offload"
            )
        return self


class SFTSettings(SupervisedSettings):
    """Step 1: causal-LM loss on prompt + response, masked to the response."""

    output_dir: str = "runs/step1_sft"
    sft_only_data_path: list[str] = Field(default_factory=list, description="datasets used whole in step 1 only")
    print_loss: bool = Field(False, description="print every rank's loss at every step")
    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="Ulysses sequence parallelism: groups of this many ranks share each micro-batch, every rank "
        "holding a slice of each (packed or padded) row; must divide the world and the model's attention heads "
        "(README 'Sequence parallelism')",
    )


class RewardSettings(SupervisedSettings):
    """Step 2: value-head model, pairwise loss ``-log sigmoid(chosen - rejected)`` on last-token scores."""

    output_dir: str = "runs/step2_reward"
    learning_rate: LearningRate = 5e-5
    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="Ulysses sequence parallelism: groups of this many ranks share each micro-batch of pairs, every "
        "rank forwarding a slice of each packed row; must divide the world and the model's attention heads "
        "(README 'Sequence parallelism')",
    )
