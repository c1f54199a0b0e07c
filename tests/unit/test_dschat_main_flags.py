"""DeepSpeed-Chat's ``main.py`` flags of steps 1-3 on hybridzero's command line: every one is accepted; steps 1-2's
``--offload`` (ZeRO-Offload) and ``--dropout`` / ``--disable_dropout`` act as in DeepSpeed-Chat."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridzero.cli import build_parser
from hybridzero.rlhf.cli import settings_from_args
from hybridzero.rlhf.settings import PPOSettings, RewardSettings, SFTSettings

# every flag of DeepSpeed-Chat's current main.py of each step (dschat/ layout), with its default: "" for a switch
# (store_true), None where the default is None ("keep the model's"/"unset"); deepspeed.add_config_arguments adds
# --deepspeed, --deepspeed_config, --deepscale, --deepscale_config to each
_COMMON12 = {
    "--data_path": "Dahoas/rm-static",
    "--data_split": "2,4,4",
    "--data_output_path": "/tmp/data_files/",
    "--model_name_or_path": "M",
    "--per_device_train_batch_size": "16",
    "--per_device_eval_batch_size": "16",
    "--max_seq_len": "512",
    "--weight_decay": "0.",
    "--num_train_epochs": "1",
    "--gradient_accumulation_steps": "1",
    "--lr_scheduler_type": "cosine",
    "--num_warmup_steps": "0",
    "--output_dir": None,
    "--seed": "1234",
    "--local_rank": "-1",
    "--gradient_checkpointing": "",
    "--dropout": None,
    "--offload": "",
    "--dtype": "fp16",
    "--zero_stage": "0",
    "--lora_dim": "0",
    "--lora_module_name": "decoder.layers.",
    "--only_optimize_lora": "",
    "--lora_learning_rate": "5e-4",
    "--compute_fp32_loss": "",
    "--enable_tensorboard": "",
    "--tensorboard_path": "step_tensorboard",
    "--add_eot_token": "",
    "--deepspeed": "",
    "--deepspeed_config": None,
    "--deepscale": "",
    "--deepscale_config": None,
}
DS_CHAT_MAIN_FLAGS: dict[str, dict[str, str | None]] = {
    "sft": {
        **_COMMON12,
        "--sft_only_data_path": None,
        "--learning_rate": "1e-3",
        "--eot_token": "<|endoftext|>",
        "--print_loss": "",
    },
    "reward": {
        **_COMMON12,
        "--num_padding_at_beginning": "1",
        "--learning_rate": "5e-5",
        "--eval_interval": "0",
        "--eval_iters": "100",
    },
    "ppo": {
        "--data_path": "Dahoas/rm-static",
        "--data_split": "2,4,4",
        "--data_output_path": "/tmp/data_files",
        "--unsupervised_dataset_name": None,
        "--unsupervised_dataset_config_name": None,
        "--unsup_coef": "27.8",
        "--actor_model_name_or_path": "A",
        "--critic_model_name_or_path": "C",
        "--num_padding_at_beginning": "1",
        "--per_device_generation_batch_size": "16",
        "--per_device_training_batch_size": "16",
        "--generation_batches": "1",
        "--ppo_epochs": "1",
        "--max_prompt_seq_len": "256",
        "--max_answer_seq_len": "256",
        "--actor_learning_rate": "9.65e-6",
        "--critic_learning_rate": "5e-6",
        "--actor_weight_decay": "0.",
        "--critic_weight_decay": "0.",
        "--num_train_epochs": "1",
        "--lr_scheduler_type": "cosine",
        "--gradient_accumulation_steps": "1",
        "--num_warmup_steps": "100",
        "--output_dir": None,
        "--seed": None,
        "--preprocessing_num_workers": None,
        "--local_rank": "-1",
        "--enable_hybrid_engine": "",
        "--unpin_actor_parameters": "",
        "--release_inference_cache": "",
        "--inference_tp_size": "1",
        "--tp_gather_partition_size": "8",
        "--offload": "",
        "--dtype": "fp16",
        "--offload_reference_model": "",
        "--offload_reward_model": "",
        "--actor_zero_stage": "0",
        "--critic_zero_stage": "0",
        "--actor_gradient_checkpointing": "",
        "--critic_gradient_checkpointing": "",
        "--actor_dropout": None,
        "--critic_dropout": None,
        "--actor_lora_dim": "0",
        "--actor_lora_module_name": "decoder.layers.",
        "--critic_lora_dim": "0",
        "--critic_lora_module_name": "decoder.layers.",
        "--only_optimize_lora": "",
        "--actor_lora_learning_rate": "5e-4",
        "--critic_lora_learning_rate": "5e-4",
        "--enable_ema": "",
        "--enable_mixed_precision_lora": "",
        "--compute_fp32_loss": "",
        "--enable_tensorboard": "",
        "--tensorboard_path": "step3_tensorboard",
        "--add_eot_token": "",
        "--align_overflow": "",
        "--print_answers": "",
        "--print_answers_interval": "1",
        "--enable_test_mode": "",
        "--test_stop_step": "0",
        "--deepspeed": "",
        "--deepspeed_config": None,
        "--deepscale": "",
        "--deepscale_config": None,
    },
}


@pytest.mark.parametrize("step", list(DS_CHAT_MAIN_FLAGS))
def test_every_deepspeed_chat_main_flag_is_accepted(step: str) -> None:
    """Each flag DeepSpeed-Chat's step ``main.py`` defines is a flag of ``hybridzero STEP``, and all of them given
    at once (switches on, others at DeepSpeed-Chat's default) parse into settings; steps 1-2 at stage 1, since
    ``--offload`` needs a ZeRO stage."""
    flags = DS_CHAT_MAIN_FLAGS[step]
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[step]  # type: ignore[union-attr]
    assert [f for f in flags if f not in sub._option_string_actions] == []
    argv = [step] + [x for f, v in flags.items() if v is not None for x in ([f, v] if v else [f])]
    argv += ["--zero_stage", "1"] if step != "ppo" else ["--actor_zero_stage", "1", "--critic_zero_stage", "1"]
    s = settings_from_args(
        {"sft": SFTSettings, "reward": RewardSettings, "ppo": PPOSettings}[step], parser.parse_args(argv)
    )
    assert s.offload and s.dtype == "fp16"


def test_steps12_offload_reaches_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--offload`` at steps 1-2 (DeepSpeed-Chat's llama2 reward scripts) builds the engine with ZeRO-Offload: the
    optimizer's block at every stage, the parameters' at stage 3 (what DeepSpeed-Chat's ``get_train_ds_config``
    asks DeepSpeed for; DeepSpeed ignores ``offload_param`` below stage 3)."""
    from types import SimpleNamespace

    from hybridzero.rlhf.settings import RewardSettings
    from hybridzero.rlhf.steps import supervised

    seen: list[dict[str, object]] = []
    monkeypatch.setattr(supervised, "world_comm", lambda: SimpleNamespace(world_size=2))
    monkeypatch.setattr(supervised, "build_engine", lambda model, cfg, **kw: seen.append(cfg["zero_optimization"]))
    for stage in (1, 3):
        argv = ["reward", "--offload", "--zero_stage", str(stage), "--per_device_train_batch_size", "2"]
        s = settings_from_args(RewardSettings, build_parser().parse_args(argv))
        assert isinstance(s, RewardSettings) and s.offload
        supervised.supervised_engine(torch.nn.Linear(2, 1), s, 64, "pairs")
    assert seen == [
        {"stage": 1, "offload_optimizer": {"device": "cpu"}},
        {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    ]


def test_steps12_dropout_acts_as_deepspeed_chat(tmp_path: Path) -> None:
    """``--dropout P`` sets the model config's dropout keys DeepSpeed-Chat's ``configure_dropout`` sets (the tiny
    Llama has ``attention_dropout``) on the model that trains; none keeps the model's own; ``--disable_dropout`` (the
    steps 1-2 scripts pass it) is ``--dropout 0``. Step 1's saved config keeps dropout 0."""
    from hybridzero.rlhf.data.demo_task import build_tokenizer
    from hybridzero.rlhf.models import load_causal_lm, load_value_model
    from tests.workers.rlhf_runs import make_model_dirs

    actor, _ = make_model_dirs(tmp_path, attention_dropout=0.25)

    def parsed(*argv: str) -> float | None:
        s = settings_from_args(RewardSettings, build_parser().parse_args(["reward", *argv]))
        assert isinstance(s, RewardSettings)
        return s.dropout

    assert (parsed(), parsed("--dropout", "0.1"), parsed("--disable_dropout")) == (None, 0.1, 0.0)
    tok = build_tokenizer()
    for dropout, expected in ((None, 0.25), (0.1, 0.1), (0.0, 0.0)):
        lm, saved = load_causal_lm(actor, tok, 0, dropout)
        assert lm.model.layers[0].self_attn.attention_dropout == expected and saved.attention_dropout == 0.0
        value = load_value_model(actor, dropout=dropout)
        assert value.transformer.layers[0].self_attn.attention_dropout == expected
    with pytest.raises(ValueError, match="dropout"):
        parsed("--dropout", "1.5")


def test_step3_critic_and_reward_load_without_dropout(tmp_path: Path) -> None:
    """Step 3's critic and reward model are built with every dropout probability 0 (``no_dropout``), whatever the
    saved config says, as ``--critic_dropout`` / ``--disable_critic_dropout``'s help states: values must be
    deterministic for W1/W2/W4 parity. A plain load keeps the config's own dropout."""
    from hybridzero.rlhf.models import load_value_model
    from tests.workers.rlhf_runs import make_model_dirs

    actor, _ = make_model_dirs(tmp_path, attention_dropout=0.25)
    assert load_value_model(actor).transformer.layers[0].self_attn.attention_dropout == 0.25
    critic = load_value_model(actor, no_dropout=True)
    assert critic.transformer.layers[0].self_attn.attention_dropout == 0.0
    assert all(not isinstance(m, torch.nn.Dropout) or m.p == 0.0 for m in critic.modules())
