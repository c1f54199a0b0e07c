"""The RLHF command line: DeepSpeed-Chat's step-3 flags parse unchanged; unsupported flags, bad values, unknown
keys and impossible batch arithmetic fail before anything starts, naming the flag and what would be valid."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hybridzero.cli import build_parser, main
from hybridzero.rlhf.cli import settings_from_args
from hybridzero.rlhf.settings import PPOSettings, SFTSettings

# the step-3 arguments of DeepSpeed-Chat's single-node OPT-1.3b training script (paths shortened)
DS_CHAT_STEP3 = """--data_path Dahoas/rm-static --data_split 2,4,4 --actor_model_name_or_path ACTOR
--critic_model_name_or_path CRITIC --num_padding_at_beginning 1 --per_device_generation_batch_size 4
--per_device_training_batch_size 4 --generation_batches 1 --ppo_epochs 1 --max_answer_seq_len 256
--max_prompt_seq_len 256 --actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6 --actor_weight_decay 0.1
--critic_weight_decay 0.1 --num_train_epochs 1 --lr_scheduler_type cosine --gradient_accumulation_steps 1
--actor_gradient_checkpointing --critic_gradient_checkpointing --offload_reference_model false
--num_warmup_steps 100 --deepspeed --seed 1234 --enable_hybrid_engine --inference_tp_size 1
--tp_gather_partition_size 8 --actor_zero_stage 3 --critic_zero_stage 3 --actor_lora_dim 0 --enable_ema
--unsup_coef 27.8 --output_dir OUT --enable_tensorboard --tensorboard_path OUT --dtype bf16""".split()  # noqa: SIM905


def _settings(argv: list[str]) -> PPOSettings:
    args = build_parser().parse_args(argv)
    settings = settings_from_args(PPOSettings, args)
    assert isinstance(settings, PPOSettings)
    return settings


def test_deepspeed_chat_step3_flags_parse_unchanged() -> None:
    s = _settings(["ppo", *DS_CHAT_STEP3])
    assert s.data_path == ["Dahoas/rm-static"] and s.data_split == "2,4,4"
    assert (s.actor_model_name_or_path, s.critic_model_name_or_path) == ("ACTOR", "CRITIC")
    assert (s.per_device_generation_batch_size, s.per_device_training_batch_size) == (4, 4)
    assert (s.generation_batches, s.ppo_epochs, s.max_answer_seq_len, s.max_prompt_seq_len) == (1, 1, 256, 256)
    assert (s.actor_learning_rate, s.critic_learning_rate, s.actor_weight_decay) == (9.65e-6, 5e-6, 0.1)
    assert s.enable_hybrid_engine and s.enable_ema and s.actor_gradient_checkpointing
    assert (s.actor_zero_stage, s.critic_zero_stage, s.unsup_coef, s.dtype) == (3, 3, 27.8, "bf16")


def test_offload_flags_map_to_the_engines_offload_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridzero.rlhf.engines import ds_config

    s = _settings(["ppo", "--offload", "--offload_reference_model", "--offload_reward_model", "false"])
    assert (s.offload, s.offload_reference_model, s.offload_reward_model) == (True, True, False)
    assert not _settings(["ppo"]).offload
    z3 = ds_config(stage=3, dtype="fp32", micro_batch=1, world_size=1, offload=True)["zero_optimization"]
    assert z3 == {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    z1 = ds_config(stage=1, dtype="fp32", micro_batch=1, world_size=1, offload=True)["zero_optimization"]
    assert z1 == {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    assert main(["reward", "--offload"]) == 2  # at DeepSpeed-Chat's default stage 0 there is no shard to offload
    err = capsys.readouterr().err
    assert "offload = True needs zero_stage 1, 2 or 3" in err and "got zero_stage = 0" in err


def test_dashed_aliases_and_bool_values() -> None:
    s = _settings(["ppo", "--enable-hybrid-engine", "false", "--generation-batches", "3", "--enable_ema"])
    assert (s.enable_hybrid_engine, s.generation_batches, s.enable_ema) == (False, 3, True)
    s = _settings(["ppo", "--enable_test_mode", "--test_stop_step", "7"])
    assert (s.enable_test_mode, s.test_stop_step, s.max_steps) == (True, 7, None)


@pytest.mark.parametrize(
    ("flag", "value", "reason"),
    [
        ("--critic_dropout", "0.2", "dropout is forced to 0"),
        ("--actor_dropout", "0.1", "dropout is forced to 0"),
    ],
)
def test_unsupported_deepspeed_chat_flags_are_named(
    flag: str, value: str | None, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["ppo", flag] + ([value] if value is not None else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert flag in err and reason in err


def test_every_step_takes_sequence_parallel_size() -> None:
    from hybridzero.rlhf.settings import RewardSettings, SFTSettings

    for command, model in (("sft", SFTSettings), ("reward", RewardSettings), ("ppo", PPOSettings)):
        got = settings_from_args(model, build_parser().parse_args([command, "--sequence_parallel_size", "2"]))
        assert isinstance(got, model) and got.sequence_parallel_size == 2, command


def test_grpo_takes_sequence_parallel_size_with_reward_functions_and_model() -> None:
    from hybridzero.rlhf.settings import GRPOSettings

    funcs = ["--reward_funcs", "m:f"]
    budget = ["--packing_samples", "--max_tokens_per_batch", "64"]
    ptx = ["--unsupervised_dataset_name", "demo", "--unsupervised_dataset_config_name", "demo"]
    vllm = [*funcs, "--rollout_engine", "vllm"]
    tp = [*funcs, "--enable_hybrid_engine", "--inference_tp_size", "2"]  # SP and TP groups: any sizes dividing W
    for given in (funcs, [], [*funcs, "--reward_model", "true"], [*funcs, "--enable_ema", *budget, *ptx], vllm, tp):
        args = build_parser().parse_args(["grpo", *given, "--sequence_parallel_size", "2"])
        s = settings_from_args(GRPOSettings, args)
        assert isinstance(s, GRPOSettings) and s.sequence_parallel_size == 2, given


def test_bad_values_and_batch_arithmetic(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["ppo", "--actor_zero_stage", "5"])
    assert exc.value.code == 2 and "invalid choice: 5" in capsys.readouterr().err
    assert main(["ppo", "--per_device_generation_batch_size", "6", "--per_device_training_batch_size", "4"]) == 2
    err = capsys.readouterr().err
    assert "per_device_generation_batch_size = 6" in err and "per_device_training_batch_size = 4" in err
    assert (
        main(
            [
                "grpo",
                "--group_size",
                "3",
                "--per_device_generation_batch_size",
                "8",
                "--per_device_training_batch_size",
                "4",
            ]
        )
        == 2
    )
    assert "group_size = 3 must divide" in capsys.readouterr().err
    assert main(["ppo", "--kl_ctl", "-1"]) == 2
    assert "--kl_ctl -1.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ppo", "--no_such_flag", "1"])
    assert "unrecognized arguments: --no_such_flag" in capsys.readouterr().err


def test_config_file_then_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sft.json"
    path.write_text(json.dumps({"learning_rate": 0.01, "max_seq_len": 64, "zero_stage": 2}))
    args = build_parser().parse_args(["sft", "--config", str(path), "--max_seq_len", "32"])
    s = settings_from_args(SFTSettings, args)
    assert isinstance(s, SFTSettings)
    assert (s.learning_rate, s.max_seq_len, s.zero_stage) == (0.01, 32, 2)
    path.write_text(json.dumps({"learnig_rate": 0.01}))
    assert main(["sft", "--config", str(path)]) == 2
    assert "unknown setting 'learnig_rate'; did you mean --learning_rate?" in capsys.readouterr().err
    path.write_text("[1, 2]")
    assert main(["sft", "--config", str(path)]) == 2
    assert "expected a JSON object" in capsys.readouterr().err


def test_plot_of_a_directory_without_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", str(tmp_path)]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [
        ("ppo", "--kl_ctl", "inf"),
        ("ppo", "--actor_learning_rate", "nan"),
        ("ppo", "--unsup_coef", "Infinity"),
        ("grpo", "--grpo_kl_coef", "-inf"),
        ("sft", "--learning_rate", "NaN"),
        ("reward", "--gradient_clipping", "inf"),
    ],
)
def test_non_finite_settings_are_refused(
    command: str, flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, f"{flag}={value}"]) == 2  # like every bad setting: before any process group or model
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{command}: error: {flag} " in err and "finite number" in err
    assert "Traceback" not in err


def test_non_finite_settings_in_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ppo.json"
    path.write_text('{"kl_ctl": NaN, "ema_beta": 0.9}')  # Python's json accepts NaN: the settings must not
    assert main(["ppo", "--config", str(path)]) == 2
    assert "--kl_ctl nan: Input should be a finite number" in capsys.readouterr().err
    with pytest.raises(ValueError, match="finite"):
        PPOSettings(cliprange=float("inf"))


def test_plot_without_matplotlib_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"phase": "sft", "step": 1, "time": 0.0, "loss": 1.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as without the `plots` extra
    assert main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == "plot: error: plotting needs matplotlib: pip install 'hybridzero[plots]'\n"
    assert not (tmp_path / "plots").exists() or not list((tmp_path / "plots").iterdir())


def test_demo_rollout_engine_flag(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import hybridzero.rlhf.cli as rlhf_cli
    from hybridzero.rlhf.demo.arith_run import arith_grpo_settings, rollout_engine_settings
    from hybridzero.rlhf.demo.run import demo_settings

    assert build_parser().parse_args(["demo"]).rollout_engine == "hf"
    assert build_parser().parse_args(["demo", "--rollout-engine", "vllm"]).rollout_engine == "vllm"
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--task", "arithmetic", "--rollout_engine", "sglang"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--rollout_engine" in err and "invalid choice: 'sglang'" in err and "'vllm'" in err
    launched: list[list[str]] = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(rlhf_cli, "_relaunch", lambda world, argv: launched.append(argv) or 0)
    assert main(["demo", "--task", "arithmetic", "--rollout_engine", "vllm", "--quick"]) == 0  # world 2: relaunch
    assert launched[0][launched[0].index("--rollout_engine") + 1] == "vllm" and "--quick" in launched[0]
    grpo = arith_grpo_settings(Path("out"), "sft", quick=True, world=2, rollout_engine="vllm")
    assert grpo.rollout_engine == "vllm" and grpo.vllm_kv_cache_gb < 1.0
    assert arith_grpo_settings(Path("out"), "sft").rollout_engine == "hf"
    assert demo_settings(Path("out"), rollout_engine="vllm")[2].rollout_engine == "vllm"
    with pytest.raises(ValueError, match="rollout_engine = 'sglang': valid values are 'hf' and 'vllm'"):
        rollout_engine_settings("sglang")
