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
local
saved copy under ``data_root`` (:mod:`hybridzero.rlhf.data.dschat`); ``model_name_or_path`` ``"demo"`` builds the
demo's tiny Llama from its config and trains it from scratch (with the demo tokenizer).


Size: over ~400 lines on purpose: every default, bound and cross-field rule of the RL steps is written once,
here, and the models share fields by inheritance; splitting them would spread one step's rules over files.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "ALGORITHM_PRESETS",
    "GRPO_ALIASES",
    "HF_SCHEDULES",
    "GRPOSettings",
    "PPOSettings",
    "RewardSettings",
    "SFTSettings",
    "StepSettings",
    "SupervisedSettings",
]

Dtype = Literal["fp32", "bf16", "fp16"]
HF_SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")
Schedule = Literal[
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "warmup_cosine"
]
Stage = Literal[0, 1, 2, 3]
LearningRate = Annotated[float, Field(gt=0.0)]
WeightDecay = Annotated[float, Field(ge=0.0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
_CONFIG = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class StepSettings(BaseModel):
    """Keys every step shares."""

    model_config = _CONFIG

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

    model_config = _CONFIG

    lora_dim: int = Field(0, ge=0)
    lora_module_name: str = "decoder.layers."
    only_optimize_lora: bool = False
    lora_learning_rate: LearningRate = 5e-4


class Step3LoRA(BaseModel):
    """Step 3: actor / critic LoRA, ``--only_optimize_lora`` for both, ``--enable_mixed_precision_lora`` (actor)."""

    model_config = _CONFIG

    actor_lora_dim: int = Field(0, ge=0)
    actor_lora_module_name: str = "decoder.layers."
    critic_lora_dim: int = Field(0, ge=0)
    critic_lora_module_name: str = "decoder.layers."
    only_optimize_lora: bool = False
    actor_lora_learning_rate: LearningRate = 5e-4
    critic_lora_learning_rate: LearningRate = 5e-4
    enable_mixed_precision_lora: bool = False


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
        1, ge=1, description="with enable_hybrid_engine: actor generation tensor-parallel over groups of N ranks"
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
        description="Ulysses sequence parallelism: groups of this many ranks share each prompt's rollouts, every "
        "actor, reference, critic and reward-model forward split over the group by sequence (README 'Sequence "
        "parallelism')",
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
        if self.inference_tp_size > 1:
            raise ValueError(
                f"inference_tp_size = {self.inference_tp_size} with rollout_engine = 'vllm': not supported "
                "(each rank runs its own vLLM engine); use 1, or rollout_engine = 'hf'"
            )
        if self.vllm_max_model_len is not None and self.vllm_max_model_len < self.max_prompt_seq_len + 1:
            raise ValueError(
                f"vllm_max_model_len = {self.vllm_max_model_len} is shorter than max_prompt_seq_len + 1 = "
                f"{self.max_prompt_seq_len + 1}"
            )
        return self

    @model_validator(mode="after")
    def _check_sequence_parallel(self) -> PPOSettings:
        """``sequence_parallel_size`` > 1 splits the actor, reference, critic and reward model: refuse the rest."""
        sp = self.sequence_parallel_size
        off = {
            "unsup_coef/unsupervised_dataset_name": self.ptx_enabled,
            "max_tokens_per_batch": self.max_tokens_per_batch is not None,
            "rollout_engine vllm": self.rollout_engine != "hf",
            "enable_ema": self.enable_ema,
            "inference_tp_size": self.inference_tp_size > 1,
        }
        given = [name for name, on in off.items() if on]
        if sp > 1 and given:
            raise ValueError(
                f"sequence_parallel_size = {sp} splits the actor, reference, critic and reward model only; turn off "
                f"{', '.join(given)} (or use sequence_parallel_size = 1)"
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


# --- GRPO family (TRL GRPOConfig spellings; docs/architecture.md "RL with verifiable rewards") ---------------------
Algorithm = Literal["grpo", "dr_grpo", "dapo", "gspo", "rloo"]
# --algorithm presets: the defaults each sets for the keys not given explicitly (papers cited in
# hybridzero.rlhf.algorithms.grpo). "dapo"'s overlong buffer is max_answer_seq_len // 4 unless given.
ALGORITHM_PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {"loss_type": "grpo", "scale_rewards": "group", "grpo_kl_coef": 0.04},
    "dr_grpo": {"loss_type": "dr_grpo", "scale_rewards": "none", "grpo_kl_coef": 0.0},
    "dapo": {
        "loss_type": "dapo",
        "scale_rewards": "group",
        "grpo_kl_coef": 0.0,
        "cliprange": 0.2,
        "epsilon_high": 0.28,
        "dynamic_sampling": True,
    },
    "gspo": {
        "loss_type": "grpo",
        "importance_sampling_level": "sequence",
        "scale_rewards": "group",
        "grpo_kl_coef": 0.0,
        "cliprange": 3e-4,
        "epsilon_high": 4e-4,
    },
    "rloo": {"loss_type": "dr_grpo", "baseline": "leave_one_out", "scale_rewards": "none", "grpo_kl_coef": 0.0},
}
# TRL GRPOConfig name -> our key (flags --num_generations ... and keys of --config / the Python API)
GRPO_ALIASES: dict[str, str] = {
    "num_generations": "group_size",
    "num_iterations": "ppo_epochs",
    "beta": "grpo_kl_coef",
    "epsilon": "cliprange",
    "max_completion_length": "max_answer_seq_len",
    "reward_model_name_or_path": "critic_model_name_or_path",
}


class GRPOSettings(PPOSettings):
    """GRPO family: ``group_size`` samples per prompt, group-relative advantages, no critic; rewards from Python
    reward functions (``reward_funcs``), the reward model, or both (weighted).

    ``algorithm`` is a preset (:data:`ALGORITHM_PRESETS`) of ``loss_type``, ``importance_sampling_level``,
    ``scale_rewards``, ``baseline``, ``grpo_kl_coef`` (``beta``), ``cliprange``/``epsilon_high``, ``dynamic_sampling``
    and the overlong buffer; a key given explicitly always wins. TRL's names are aliases (:data:`GRPO_ALIASES`).
    """

    output_dir: str = "runs/step3_grpo"
    algorithm: Algorithm = "grpo"
    group_size: int = Field(4, ge=2, description="samples per prompt (TRL: --num_generations)")
    grpo_kl_coef: float = Field(0.04, ge=0.0, description="k3 KL to the reference in the loss (TRL: --beta)")
    epsilon_high: float | None = Field(None, gt=0.0, description="upper clip (DAPO clip-higher); default: cliprange")
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = "grpo"
    importance_sampling_level: Literal["token", "sequence"] = "token"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    baseline: Literal["group_mean", "leave_one_out"] = Field("group_mean", description="leave_one_out: RLOO")
    mask_truncated_completions: bool = Field(False, description="answers that hit the length limit get no gradient")
    dynamic_sampling: bool = Field(False, description="DAPO: regenerate groups whose rewards are all equal")
    max_resample_rounds: int = Field(2, ge=0, description="dynamic sampling: extra generation rounds at most")
    overlong_buffer_length: int = Field(0, ge=0, description="DAPO overlong shaping buffer in tokens (0: off)")
    overlong_penalty: float = Field(1.0, ge=0.0, description="DAPO overlong shaping: penalty at the length limit")
    reward_funcs: list[str] = Field(
        default_factory=list, description="reward functions, module:function or path/to/file.py:function"
    )
    reward_weights: list[float] | None = Field(
        None, description="one weight per reward function, then the reward model's (default: all 1)"
    )
    reward_model: bool | None = Field(
        None,
        description="score with the reward model too (default: when no reward function is given, or when "
        "--critic_model_name_or_path / --reward_model_name_or_path is given)",
    )
    reward_timeout: float = Field(60.0, ge=0.0, description="seconds per reward-function call (0: in-process)")
    reward_error_policy: Literal["raise", "skip"] = Field(
        "raise", description="a reward function that raises, hangs or returns NaN: fail the run, or skip the sample"
    )
    stop_strings: list[str] = Field(default_factory=list, description="generation stops after any of these strings")

    @model_validator(mode="before")
    @classmethod
    def _aliases_and_preset(cls, data: Any) -> Any:
        """TRL aliases -> our keys, then the ``algorithm`` preset for every key not given."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for alias, key in GRPO_ALIASES.items():
            if alias in data:
                value = data.pop(alias)
                if key in data and data[key] != value:
                    raise ValueError(f"--{alias} {value!r} and --{key} {data[key]!r} are the same setting; give one")
                data[key] = value
        algorithm = data.get("algorithm", "grpo")
        preset = dict(ALGORITHM_PRESETS.get(algorithm, {}))
        if algorithm == "dapo":
            answer = data.get("max_answer_seq_len", cls.model_fields["max_answer_seq_len"].default)
            preset["overlong_buffer_length"] = max(int(answer) // 4, 1) if isinstance(answer, int) else 0
        for key, value in preset.items():
            data.setdefault(key, value)
        return data

    @property
    def clip_high(self) -> float:
        """The upper clip ``epsilon_high`` (``cliprange`` when not set)."""
        return self.cliprange if self.epsilon_high is None else self.epsilon_high

    def uses_reward_model(self, n_api_funcs: int = 0) -> bool:
        """Whether the reward model scores too (``reward_model``, else: no reward function at all, or its path
        given explicitly); ``n_api_funcs`` counts reward functions given through the Python API."""
        if self.reward_model is not None:
            return self.reward_model
        return not (self.reward_funcs or n_api_funcs) or "critic_model_name_or_path" in self.model_fields_set

    @model_validator(mode="after")
    def _check_groups(self) -> GRPOSettings:
        """Every prompt's group lives on one rank and in one training mini-batch; weights match the sources."""
        gen, train, k = self.per_device_generation_batch_size, self.per_device_training_batch_size, self.group_size
        if gen % k or train % k:
            raise ValueError(
                f"group_size = {k} must divide per_device_generation_batch_size = {gen} and "
                f"per_device_training_batch_size = {train}"
            )
        if self.reward_model is False and not self.reward_funcs:
            raise ValueError("reward_model = false needs at least one --reward_funcs entry (no reward source left)")
        if self.reward_weights is not None and self.reward_funcs:
            want = len(self.reward_funcs) + int(self.uses_reward_model())
            if len(self.reward_weights) != want:
                raise ValueError(
                    f"reward_weights {self.reward_weights} has {len(self.reward_weights)} entries; expected {want} "
                    f"(one per reward function{', then the reward model' if self.uses_reward_model() else ''})"
                )
        if self.overlong_buffer_length >= self.max_answer_seq_len:
            raise ValueError(
                f"overlong_buffer_length = {self.overlong_buffer_length} must be below max_answer_seq_len = "
                f"{self.max_answer_seq_len} (the buffer is the last stretch before the limit)"
            )
        return self
