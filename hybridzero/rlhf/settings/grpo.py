"""The GRPO family (GRPO, Dr. GRPO, DAPO, GSPO, RLOO) on step 3's keys: ``--algorithm`` presets, TRL's
``GRPOConfig`` spellings as aliases, and the rules of groups and reward sources."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from hybridzero.rlhf.settings.ppo import PPOSettings

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
    old_logprobs: Literal["auto", "rollout_pass"] = Field(
        "auto",
        description="auto: when an iteration is one on-policy optimizer step (one pass, mini-batches = "
        "gradient_accumulation_steps, no dropout, no ptx between mini-batches, no IS correction) the loss's old "
        "log-probs are the update forward's own, detached (TRL's rule), and the rollout skips that actor pass; "
        "rollout_pass: always a separate no-grad pass at rollout",
    )

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
