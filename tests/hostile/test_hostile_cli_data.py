"""Hostile command lines and data files (issue 28): each ends in a one-line error naming the flag and value, or the
file and line, before anything is trained, and leaves no process behind."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridzero.cli import main
from hybridzero.rlhf.data.records import load_records
from hybridzero.rlhf.rewards.containment import live_pids
from tests.workers.rlhf_runs import make_model_dirs
from tests.workers.rlvr_runs import _child_pids

R = "tests.workers.rlvr_rewards:digit_share"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_model_dirs(tmp_path_factory.mktemp("hostile_models"))


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    before = _child_pids()
    yield
    assert live_pids(_child_pids() - before) == []


DATA: dict[str, tuple[bytes, str, str]] = {  # name -> (file bytes, suffix, expected error text)
    "empty": (b"", ".jsonl", "dataset is empty"),
    "blank_lines_only": (b"\n\n  \n", ".jsonl", "dataset is empty"),
    "non_utf8": (
        b'{"prompt": "a", "response": "b"}\n{"prompt": "\xff\xfe", "response": "b"}\n',
        ".jsonl",
        ":2: not UTF-8",
    ),
    "latin1_json": (b'[{"prompt": "caf\xe9", "response": "b"}]', ".json", ":1: not UTF-8 text (byte 0xe9"),
    "malformed_line": (b'{"prompt": "a", "response": "b"}\n\n{"prompt": \n', ".jsonl", ":3: invalid JSON line"),
    "nul_bytes": (b'{"prompt": "a", "response": "b"}\n\x00\x00\n', ".jsonl", ":2: invalid JSON line"),
    "truncated_json": (b'[{"prompt": "a"', ".json", ":1: invalid JSON"),
    "json_not_list": (b'{"prompt": "a", "response": "b"}', ".json", "expected a JSON list of objects, got dict"),
    "row_not_object": (b'{"prompt": "a", "response": "b"}\n\n7\n', ".jsonl", ":3: record 1 is int"),
    "missing_field": (b'{"prompt": "a", "answer": "b"}\n', ".jsonl", ":1: record 0 is missing column(s) ['response']"),
    "wrong_type": (b'{"prompt": 3, "response": "b"}\n', ".jsonl", ":1: record 0 column(s) ['prompt'] are not strings"),
    "null_field": (b'{"prompt": null, "response": "b"}\n', ".jsonl", "column(s) ['prompt'] are not strings"),
    "deeply_nested": (b"[" * 100000 + b"]" * 100000, ".json", "nested too deeply"),
    "wrong_suffix": (b"prompt,response\n", ".csv", "unsupported file type '.csv'"),
    "pairwise_missing": (b'{"prompt": "a", "chosen": "b"}\n', ".jsonl", "missing column(s) ['rejected']"),
}


@pytest.mark.parametrize("name", sorted(DATA))
def test_a_hostile_data_file_names_file_and_line(tmp_path: Path, name: str) -> None:
    body, suffix, expected = DATA[name]
    path = tmp_path / f"{name}{suffix}"
    path.write_bytes(body)
    with pytest.raises(ValueError) as info:
        load_records(path)
    message = str(info.value)
    assert str(path) in message and expected in message and "\n" not in message, message


def test_a_bom_and_one_huge_line_are_read(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    huge = "9 " * 500_000
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": huge, "response": "b"}).encode() + b"\n")
    assert load_records(path) == [{"prompt": huge, "response": "b"}]


@pytest.mark.parametrize(
    ("path", "error"),
    [("/nonexistent/hostile.jsonl", FileNotFoundError), ("../../../nonexistent-hostile.json", FileNotFoundError)],
)
def test_a_missing_data_path_is_named(path: str, error: type[Exception]) -> None:
    with pytest.raises(error, match="no dataset at"):
        load_records(path)


CLI: dict[str, tuple[list[str], int, str]] = {  # name -> (argv after the model flags, exit code, expected text)
    "negative_epochs": (["sft", "--num_train_epochs", "-1"], 2, "--num_train_epochs -1"),
    "zero_batch": (["sft", "--per_device_train_batch_size", "0"], 2, "--per_device_train_batch_size 0"),
    "nan_lr": (["sft", "--learning_rate", "nan"], 2, "--learning_rate nan: Input should be a finite number"),
    "inf_lr": (["sft", "--learning_rate", "inf"], 2, "--learning_rate inf"),
    "negative_lr": (["sft", "--learning_rate", "-1"], 2, "--learning_rate -1.0"),
    "zero_seq_len": (["sft", "--max_seq_len", "0"], 2, "--max_seq_len 0"),
    "reward_negative_batch": (["reward", "--per_device_train_batch_size", "-2"], 2, "--per_device_train_batch_size -2"),
    "grpo_negative_timeout": (["grpo", "--reward_timeout", "-1", "--reward_funcs", R], 2, "--reward_timeout -1"),
    "grpo_nan_timeout": (["grpo", "--reward_timeout", "nan", "--reward_funcs", R], 2, "--reward_timeout nan"),
    "grpo_nan_weight": (
        ["grpo", "--reward_weights", "nan", "--reward_funcs", R],
        2,
        "--reward_weights.0 'nan': Input should be a finite number",
    ),
    "grpo_weights_count": (["grpo", "--reward_funcs", R, "--reward_weights", "1", "2"], 2, "has 2 entries; expected 1"),
    "grpo_spec_missing_module": (["grpo", "--reward_funcs", "no_such_mod_xyz:f"], 1, "'no_such_mod_xyz:f'"),
    "grpo_spec_not_callable": (["grpo", "--reward_funcs", "os:sep"], 1, "sep is a str, not a function"),
    "grpo_spec_dotdot": (["grpo", "--reward_funcs", "../../nope_hostile.py:f"], 1, "no file ../../nope_hostile.py"),
    "grpo_spec_no_colon": (["grpo", "--reward_funcs", "os.path"], 1, "expected module:function"),
    "config_missing": (["sft", "--config", "/nonexistent/hostile.json"], 2, "--config /nonexistent/hostile.json"),
}


def _argv(step: str, actor: str, value: str) -> list[str]:
    if step in ("sft", "reward"):
        return ["--model_name_or_path", actor, "--data_path", "demo"]
    if step == "grpo":  # reward functions only: no reward model
        return ["--actor_model_name_or_path", actor, "--data_path", "demo"]
    return ["--actor_model_name_or_path", actor, "--critic_model_name_or_path", value, "--data_path", "demo"]


@pytest.mark.parametrize("name", sorted(CLI))
def test_a_hostile_command_line_is_one_line_naming_flag_and_value(
    name: str, models: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str], no_leftovers: None
) -> None:
    argv, code, expected = CLI[name]
    out = ["--output_dir", str(tmp_path / "out")]
    assert main([argv[0], *_argv(argv[0], *models), *out, *argv[1:]]) == code
    err = capsys.readouterr().err.strip()
    assert expected in err and err.startswith(f"{argv[0]}: error:"), err
    assert not (tmp_path / "out").exists()  # nothing was trained or written


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("/nonexistent/dir", "no such directory"),
        ("../../../../etc", "no config.json in that directory"),
        ("/etc/passwd", "no config.json in that directory"),
    ],
)
def test_a_bad_model_directory_is_named(
    model: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sft", "--model_name_or_path", model, "--data_path", "demo", "--output_dir", str(tmp_path / "o")]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err == err.splitlines()[-1] and repr(model) in err and expected in err, err


def test_a_config_file_that_is_not_utf8_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(b'{"learning_rate": "\xff"}')
    assert main(["sft", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--config {path}: cannot read a JSON object" in err


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--algorithm", "ppo2"), ("--reward_error_policy", "ignore"), ("--world_size", "x"), ("--learnin_rate", "1")],
)
def test_a_bad_choice_is_named_by_the_parser(flag: str, value: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hybridzero", "grpo", flag, value],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    named = repr(value) in done.stderr or flag in done.stderr
    assert done.returncode == 2 and "error:" in done.stderr and named, done.stderr
