"""Step 3 (PPO): DeepSpeed-Chat's keys, the hyperparameters it hard-codes, the rollout engine and its cross-field
rules."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from hybridzero.rlhf.settings.common import Dtype, Fraction, LearningRate, Stage, Step3LoRA, StepSettings, WeightDecay


class PPOSettings(StepSettings, Step3LoRA):
    """Step 3 (DeepSpeed-Chat names; hyperparameters DeepSpeed-Chat hard-codes are keys here)."""

    output_dir: str = "runs/step3_ppo"
    actor_model_name_or_path: str = "runs/step1_sft"
    critic_model_name_or_path: str = "runs/step2_reward"
    per_device_generation_batch_size: int = Field(16, ge=1)
    per_device_training_batch_size: int = Field(16, ge=1)
    generation_batches: int = Field(1, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    max_prompt_seq_len: int = Field(256, ge=1)
    max_answer_seq_len: int = Field(256, ge=1)
    prompt_policy: Literal["truncate", "drop"] = "drop"
    actor_learning_rate: LearningRate = 9.65e-6
    critic_learning_rate: LearningRate = 5e-6
    actor_weight_decay: WeightDecay = 0.0
    critic_weight_decay: WeightDecay = 0.0
    num_warmup_steps: int = Field(100, ge=0)
    actor_zero_stage: Stage = 0
    critic_zero_stage: Stage = 0
    reference_zero_stage: Stage | None = Field(None, description="default: actor_zero_stage (DeepSpeed-Chat)")
    reward_zero_stage: Stage | None = Field(None, description="default: critic_zero_stage (DeepSpeed-Chat)")
    actor_gradient_checkpointing: bool = False
    critic_gradient_checkpointing: bool = False
    enable_hybrid_engine: bool = False
    inference_tp_size: int = Field(
        1,
        ge=1,
        description="actor generation tensor-parallel over groups of N consecutive ranks: the hybrid engine's (with "
        "enable_hybrid_engine) or, with rollout_engine vllm, one vLLM engine per group",
    )
    tp_gather_partition_size: int = Field(8, ge=1, description="layers gathered at once while cutting the TP copies")
    # Rollout engine (hybridzero.rlhf.rollout.backends): hf = hybrid-engine / ZeRO-3 generation, vllm = colocated vLLM
    rollout_engine: Literal["hf", "vllm"] = "hf"
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0.0, le=1.0, description="GPU: the vLLM engine's share")
    vllm_kv_cache_gb: float = Field(1.0, gt=0.0, description="vLLM's KV cache (GiB; on CPU VLLM_CPU_KVCACHE_SPACE)")
    vllm_max_model_len: int | None = Field(None, ge=2, description="default: max_prompt_seq_len + max_answer_seq_len")
    vllm_enforce_eager: bool = True
    vllm_dtype: Dtype | None = Field(
        None,
        description="vLLM's dtype (default: --dtype); bf16 samples faster on bf16 CPUs/GPUs while training stays fp32",
    )
    vllm_enable_sleep_mode: bool = Field(False, description="free vLLM's memory while training (GPU only)")
    vllm_importance_sampling_correction: bool = False
    vllm_importance_sampling_cap: float = Field(3.0, gt=0.0, description="truncation of the sampler/trainer ratio")
    # DeepSpeed-Chat's ZeRO-Offload flags: actor + critic / reference + EMA / reward model state on the host
    offload: bool = Field(False, description="actor and critic: fp32 master, gradients and Adam state on the host")
    offload_reference_model: bool = Field(False, description="reference (and EMA) model shards on the host")
    offload_reward_model: bool = Field(False, description="reward model shards on the host")
    enable_ema: bool = False
    ema_beta: float = Field(0.992, gt=0.0, lt=1.0)
    unsupervised_dataset_name: str | None = None
    unsupervised_dataset_config_name: str | None = Field(
        None, description="ptx is on only when both this and unsupervised_dataset_name are given (DeepSpeed-Chat)"
    )
    unsup_coef: float = Field(27.8, ge=0.0)
    kl_ctl: float = Field(0.1, ge=0.0)
    clip_reward_value: float = Field(5.0, gt=0.0)
    cliprange: float = Field(0.2, gt=0.0)
    cliprange_value: float = Field(0.2, gt=0.0)
    gamma: Fraction = 1.0
    lambd: Fraction = 0.95
    do_sample: bool = True
    temperature: float = Field(1.0, gt=0.0)
    top_k: int = Field(0, ge=0)
    save_interval: int = Field(0, ge=0, description="checkpoint every N PPO steps (0: only at the end)")
    resume: bool = True
    monitor: Literal["none", "demo"] = "none"
    print_answers: bool = False
    enable_test_mode: bool = Field(False, description="stop after test_stop_step generation batches (or one epoch)")
    test_stop_step: int = Field(0, ge=0, description="with enable_test_mode: generation batches to run")
    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="Ulysses sequence parallelism: groups of this many ranks share each data rank's rollouts (each "
        "rank generates 1/N of the samples on any rollout engine, the rows all-gathered in the group) and ptx "
        "batches, every actor, reference, critic and reward-model forward split over the group by sequence (README "
        "'Sequence parallelism')",
    )

    @property
    def ptx_enabled(self) -> bool:
        """DeepSpeed-Chat's rule: unsupervised training needs both dataset names."""
        return bool(self.unsupervised_dataset_name) and bool(self.unsupervised_dataset_config_name)

    def stage_of(self, role: str) -> int:
        """ZeRO stage of ``role`` (actor, critic, reference, reward): reference follows the actor and reward the
        critic unless set."""
        own = {"reference": self.reference_zero_stage, "reward": self.reward_zero_stage}.get(role)
        if own is not None:
            return own
        return self.critic_zero_stage if role in ("critic", "reward") else self.actor_zero_stage

    @model_validator(mode="after")
    def _check_rollout_engine(self) -> PPOSettings:
        """vLLM rollouts: what they cannot be combined with, in one line each."""
        if self.rollout_engine != "vllm":
            if self.vllm_importance_sampling_correction:
                raise ValueError("vllm_importance_sampling_correction needs rollout_engine = 'vllm'")
            return self
        if self.vllm_max_model_len is not None and self.vllm_max_model_len < self.max_prompt_seq_len + 1:
            raise ValueError(
                f"vllm_max_model_len = {self.vllm_max_model_len} is shorter than max_prompt_seq_len + 1 = "
                f"{self.max_prompt_seq_len + 1}"
            )
        return self

    @model_validator(mode="after")
    def _check_batches(self) -> PPOSettings:
        """The generation batch must split into whole training mini-batches."""
        gen, train = self.per_device_generation_batch_size, self.per_device_training_batch_size
        if gen % train:
            raise ValueError(
                f"per_device_generation_batch_size = {gen} is not a multiple of "
                f"per_device_training_batch_size = {train}; use a divisor of {gen}"
            )
        return self
