"""Hostile command lines (issue 28): every option of every ``hybridzero`` command fails fast on a bad value, with
exit status 2 and one line naming the option, the value and what is valid; nothing is trained or started.

The commands run through :func:`hybridzero.cli.main` with the parts after validation (relaunch, model checks,
training, plan, export, conversion, plots, demo, torchrun) replaced by a stub that fails the test, so a case that
slips through validation is reported instead of starting work. An fp16 loss-scale underflow in a training step
ends in one line naming ``fp16.min_loss_scale`` and the step's own flags (exit 1), not a traceback.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

import pytest

import hybridzero.cli as top_cli
import hybridzero.launch as launch
import hybridzero.plan.cli as plan_cli
import hybridzero.rlhf.cli as rlhf_cli
from hybridzero.argtypes import MAX_LOCAL_RANKS, CLIParser, float_range, int_range, path_text
from hybridzero.cli import build_parser, main
from hybridzero.optim.loss_scaler import LossScaler, LossScaleUnderflowError, ScalerConfig

PLAN = ["plan", "--model", "bench-llama", "--config", "ds.json"]
NUL = "a\x00b"

# name -> (argv, text the one error line must hold: the option as the user wrote it, or its setting's key)
CASES: dict[str, tuple[list[str], str]] = {
    # abbreviations: a prefix of an option is an unknown argument, never that option
    "abbrev_sft_learning": (["sft", "--learning", "1e-3"], "--learning"),
    "abbrev_sft_lr": (["sft", "--lr", "1e-3"], "--lr"),
    "abbrev_ppo_actor_lr": (["ppo", "--actor_learning", "1e-5"], "--actor_learning"),
    "abbrev_ppo_world": (["ppo", "--world", "2"], "--world"),
    "abbrev_grpo_num_gen": (["grpo", "--num_gen", "4"], "--num_gen"),
    "abbrev_reward_per_device": (["reward", "--per_device_train", "8"], "--per_device_train"),
    "abbrev_plan_gpus": ([*PLAN, "--gpus", "4"], "--gpus"),
    "abbrev_export_shard": (["export", "ck", "out", "--max-shard", "5GB"], "--max-shard"),
    "abbrev_convert_from": (["convert-checkpoint", "old", "new", "--fr", "deepspeed"], "--fr"),
    "abbrev_demo_quick": (["demo", "--qui"], "--qui"),
    "abbrev_plot_out": (["plot", "run", "--ou", "x"], "--ou"),
    # counts and sizes below their minimum, and absurd process counts
    "plan_nodes_zero": ([*PLAN, "--nodes", "0"], "--nodes"),
    "plan_nodes_negative": ([*PLAN, "--nodes", "-3"], "--nodes"),
    "plan_gpus_zero": ([*PLAN, "--gpus_per_node", "0"], "--gpus_per_node"),
    "plan_seq_len_negative": ([*PLAN, "--seq_len", "-1"], "--seq_len"),
    "plan_top_zero": ([*PLAN, "--top", "0"], "--top"),
    "plan_prompt_len_zero": ([*PLAN, "--prompt_len", "0"], "--prompt_len"),
    "plan_answer_len_negative": ([*PLAN, "--answer_len", "-5"], "--answer_len"),
    "sft_world_negative": (["sft", "--world_size", "-1"], "--world_size"),
    "ppo_world_huge": (["ppo", "--world-size", str(MAX_LOCAL_RANKS + 1)], "--world_size"),
    "demo_world_zero": (["demo", "--world_size", "0"], "--world_size"),
    "sft_batch_zero": (["sft", "--per_device_train_batch_size", "0"], "--per_device_train_batch_size"),
    "sft_epochs_zero": (["sft", "--num_train_epochs", "0"], "--num_train_epochs"),
    "ppo_epochs_negative": (["ppo", "--ppo_epochs", "-1"], "--ppo_epochs"),
    "grpo_group_one": (["grpo", "--group_size", "1"], "--group_size"),
    "sft_accumulation_zero": (["sft", "--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps"),
    "sft_seq_len_one": (["sft", "--max_seq_len", "1"], "--max_seq_len"),
    "ppo_answer_len_zero": (["ppo", "--max_answer_seq_len", "0"], "--max_answer_seq_len"),
    "sft_max_steps_zero": (["sft", "--max_steps", "0"], "--max_steps"),
    "ppo_warmup_negative": (["ppo", "--num_warmup_steps", "-1"], "--num_warmup_steps"),
    "sft_lora_dim_negative": (["sft", "--lora_dim", "-1"], "--lora_dim"),
    "ppo_top_k_negative": (["ppo", "--top_k", "-1"], "--top_k"),
    # rates, coefficients, probabilities, temperature, timeouts: nan, inf, overflow, out of range
    "sft_lr_nan": (["sft", "--learning_rate", "nan"], "--learning_rate"),
    "sft_lr_zero": (["sft", "--learning_rate", "0"], "--learning_rate"),
    "ppo_temperature_zero": (["ppo", "--temperature", "0"], "--temperature"),
    "ppo_temperature_inf": (["ppo", "--temperature", "inf"], "--temperature"),
    "ppo_gamma_above_one": (["ppo", "--gamma", "1.5"], "--gamma"),
    "ppo_lambd_negative": (["ppo", "--lambd", "-0.1"], "--lambd"),
    "ppo_ema_beta_one": (["ppo", "--ema_beta", "1"], "--ema_beta"),
    "ppo_kl_overflow": (["ppo", "--kl_ctl", "1e999"], "--kl_ctl"),
    "ppo_vllm_memory_zero": (["ppo", "--vllm_gpu_memory_utilization", "0"], "--vllm_gpu_memory_utilization"),
    "grpo_timeout_negative": (["grpo", "--reward_timeout", "-1"], "--reward_timeout"),
    "grpo_kl_nan": (["grpo", "--grpo_kl_coef", "nan"], "--grpo_kl_coef"),
    "grpo_beta_negative": (["grpo", "--beta", "-1"], "--grpo_kl_coef"),  # TRL's alias: the key is named
    "sft_eval_fraction_one": (["sft", "--eval_fraction", "1"], "--eval_fraction"),
    "reward_clipping_negative": (["reward", "--gradient_clipping", "-1"], "--gradient_clipping"),
    "sft_weight_decay_negative": (["sft", "--weight_decay", "-0.1"], "--weight_decay"),
    "export_shard_nan": (["export", "ck", "out", "--max-shard-size", "nan"], "--max-shard-size"),
    "export_shard_inf": (["export", "ck", "out", "--max-shard-size", "1e999GB"], "--max-shard-size"),
    "export_shard_zero": (["export", "ck", "out", "--max-shard-size", "0"], "--max-shard-size"),
    # text where a number or a switch belongs
    "plan_nodes_word": ([*PLAN, "--nodes", "two"], "--nodes"),
    "plan_top_float": ([*PLAN, "--top", "2.5"], "--top"),
    "sft_lr_word": (["sft", "--learning_rate", "fast"], "--learning_rate"),
    "ppo_epochs_float": (["ppo", "--ppo_epochs", "1.5"], "--ppo_epochs"),
    "sft_stage_word": (["sft", "--zero_stage", "x"], "--zero_stage"),
    "sft_world_word": (["sft", "--world_size", "x"], "--world_size"),
    "demo_world_word": (["demo", "--world_size", "two"], "--world_size"),
    "sft_bool_word": (["sft", "--enable_tensorboard", "maybe"], "--enable_tensorboard"),
    "grpo_weights_word": (["grpo", "--reward_weights", "x"], "--reward_weights"),
    "ppo_huge_int_text": (["ppo", "--ppo_epochs", "1e30"], "--ppo_epochs"),
    # empty strings
    "plan_nodes_empty": ([*PLAN, "--nodes", ""], "--nodes"),
    "sft_lr_empty": (["sft", "--learning_rate", ""], "--learning_rate"),
    "sft_output_dir_empty": (["sft", "--output_dir", ""], "--output_dir"),
    "ppo_actor_empty": (["ppo", "--actor_model_name_or_path", ""], "--actor_model_name_or_path"),
    "export_ckpt_empty": (["export", "", "out"], "CKPT_DIR"),
    "sft_config_empty": (["sft", "--config", ""], "--config"),
    "plan_model_empty": (["plan", "--model", "", "--config", "ds.json"], "--model"),
    "sft_data_path_empty": (["sft", "--data_path", ""], "--data_path"),
    # NUL bytes in paths (the OS refuses them; the error must name the option, not just "embedded null byte")
    "export_ckpt_nul": (["export", NUL, "out"], "CKPT_DIR"),
    "export_tag_nul": (["export", "ck", "out", "--tag", NUL], "--tag"),
    "convert_new_nul": (["convert-checkpoint", "old", NUL], "NEW_DIR"),
    "plot_run_nul": (["plot", NUL], "RUN_DIR"),
    "sft_output_dir_nul": (["sft", "--output_dir", NUL], "--output_dir"),
    "sft_model_nul": (["sft", "--model_name_or_path", NUL], "--model_name_or_path"),
    "plan_json_nul": ([*PLAN, "--json", NUL], "--json"),
    "sft_config_nul": (["sft", "--config", NUL], "--config"),
    "demo_output_nul": (["demo", "--output_dir", NUL], "--output_dir"),
    "ppo_data_path_nul": (["ppo", "--data_path", "demo", NUL], "--data_path"),
    "grpo_reward_model_nul": (["grpo", "--reward_model_name_or_path", NUL], "--reward_model_name_or_path"),
    "sft_data_root_nul": (["sft", "--data_root", NUL], "--data_root"),
    # the launcher parses its own flags (everything after STEP belongs to the step)
    "launch_gpus_negative": (["launch", "--num_gpus", "-1", "sft"], "--num_gpus"),
    "launch_gpus_word": (["launch", "--num_gpus", "x", "sft"], "--num_gpus"),
    "launch_node_rank_negative": (["launch", "--node_rank", "-2", "sft"], "--node_rank"),
}


def _never(*_args: Any, **_kwargs: Any) -> NoReturn:
    raise AssertionError("a hostile command line got past validation")


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stage after validation fails the test instead of starting work."""
    for module, name in (
        (rlhf_cli, "_relaunch"),
        (rlhf_cli, "_check_models"),
        (rlhf_cli, "_plot"),
        (rlhf_cli, "_demo"),
        (plan_cli, "run_plan"),
        (top_cli, "_export"),
        (top_cli, "_convert"),
        (launch, "torchrun_command"),
    ):
        monkeypatch.setattr(module, name, _never)


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse errors exit; settings errors return
        return int(exc.code) if isinstance(exc.code, int) else 1


def test_there_are_at_least_forty_cases() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_argument_is_one_line_exit_2_naming_the_option(
    name: str, nothing_runs: None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, option = CASES[name]
    assert _exit_code(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err and "\n" not in err, err
    assert "error:" in err and option in err, err
    assert "Traceback" not in err and captured.out == ""


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.extend(_parsers(sub))
    return found


def test_every_parser_refuses_abbreviations_and_errs_in_one_line() -> None:
    parsers = _parsers(build_parser())
    assert len(parsers) >= 10  # the top level and every subcommand
    for parser in parsers:
        assert isinstance(parser, CLIParser) and parser.allow_abbrev is False, parser.prog


def test_valid_values_and_defaults_are_unchanged(tmp_path: Any) -> None:
    args = build_parser().parse_args([*PLAN, "--nodes=2", "--gpus_per_node", "4", "--top", "3"])
    assert (args.nodes, args.gpus_per_node, args.seq_len, args.prompt_len, args.answer_len, args.top) == (
        2,
        4,
        2048,
        256,
        256,
        3,
    )
    args = build_parser().parse_args(
        ["sft", "--learning_rate=1e-4", "--output-dir", str(tmp_path), "--zero_stage", "3"]
    )
    assert (args.learning_rate, args.output_dir, args.zero_stage, args.world_size) == (1e-4, str(tmp_path), 3, 0)
    args = build_parser().parse_args(["ppo", "--world_size", "0", "--data_path", "demo", "local/set"])
    assert (args.world_size, args.data_path) == (0, ["demo", "local/set"])
    assert build_parser().parse_args(["demo"]).world_size == 2
    assert build_parser().parse_args(["export", "a", "b"]).max_shard_size == 5 * 2**30


def test_type_functions_name_value_and_range() -> None:
    positive = int_range(1)
    assert positive(" 7 ") == 7
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer >= 1, got '0'"):
        positive("0")
    with pytest.raises(argparse.ArgumentTypeError, match=r"an integer >= 0 and <= 4, got '5'"):
        int_range(0, 4)("5")
    fraction = float_range(0.0, 1.0)
    assert fraction("0") == 0.0 and fraction("1") == 1.0
    for bad in ("nan", "inf", "-inf", "1e999", "1.01", "", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"a finite number >= 0 and <= 1"):
            fraction(bad)
    with pytest.raises(argparse.ArgumentTypeError, match=r"a finite number > 0, got '0'"):
        float_range(0.0, min_open=True)("0")
    assert path_text("runs/x") == "runs/x"
    for bad in ("", NUL):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a path"):
            path_text(bad)


def _underflow() -> LossScaleUnderflowError:
    """The error the engine's real fp16 loss scaler raises when gradients overflow at the minimum scale."""
    scaler = LossScaler(ScalerConfig.from_fp16(True, 0.0, 0, 100, 1, False, 1.0))
    try:
        scaler.update(True)
    except LossScaleUnderflowError as exc:
        return exc
    raise AssertionError("the scaler did not underflow")


@pytest.mark.parametrize(
    ("command", "train", "rate"),
    [("sft", "train_sft", "--learning_rate"), ("grpo", "train_step3", "--actor_learning_rate")],
)
def test_fp16_loss_scale_underflow_is_one_line_naming_the_keys(
    command: str, train: str, rate: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    error = _underflow()

    def raise_underflow(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise error

    monkeypatch.setattr(rlhf_cli, "_check_models", lambda _settings: None)
    monkeypatch.setattr(rlhf_cli, train, raise_underflow)
    assert main([command, "--dtype", "fp16", "--data_path", "demo"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"{command}: error: fp16 loss scale already at its minimum"), err
    assert "fp16.min_loss_scale = 1" in err and "--dtype bf16" in err and rate in err, err
    with pytest.raises(LossScaleUnderflowError):  # --debug: the traceback
        main([command, "--dtype", "fp16", "--data_path", "demo", "--debug"])
