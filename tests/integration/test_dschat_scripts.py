"""DeepSpeed-Chat's own launch scripts through ``hybridzero launch --num_gpus 2`` at world 2.

The 28 scripts' ``deepspeed ... main.py ARGS`` lines are data (:mod:`tests.integration.dschat_script_args`, with
their source and the shell substitutions). The test replaces values by flag only: the model of
``--model_name_or_path`` / ``--actor_model_name_or_path`` is the tiny Llama (the critic's a tiny value model),
``--output_dir`` / ``--tensorboard_path`` a temporary folder; lengths shrink (``--max_seq_len`` 32, answers 8 and
prompts 12 tokens, also where the script leaves DeepSpeed-Chat's default of 512 / 256); ``--inference_tp_size`` is
at most the world size (2); every LoRA module name points at the tiny Llama's blocks (``layers.``). The DeepSpeed-Chat
dataset names resolve to small fixtures in every schema through ``$HYBRIDZERO_DATA_ROOT`` (no download). The
launcher gets ``--num_gpus 2`` in place of the script's ``--num_gpus`` / ``--master_port`` and keeps its other flags
(``--bind_cores_to_rank``). For CI cost each run appends a stop (``--max_steps 2`` for steps 1-2,
``--enable_test_mode --test_stop_step 2`` for step 3) and ``--progress false``.

Every script parses (fast test). Every script runs (slow test), except the five of ``SHARED_RUNS``: each has the
flags of another script in the same roles, only other values, so it takes that script's code path; a fast test
checks that their flag sets are equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridzero.cli import build_parser
from hybridzero.launch import parse_launch
from hybridzero.rlhf.cli import settings_from_args
from hybridzero.rlhf.settings import PPOSettings, RewardSettings, SFTSettings
from tests.integration.dschat_script_args import SCRIPTS, SHARED_RUNS, Script
from tests.workers.rlhf_runs import make_model_dirs

_MODELS = {"sft": SFTSettings, "reward": RewardSettings, "ppo": PPOSettings}
_STOP = {
    "sft": ["--max_steps", "2"],
    "reward": ["--max_steps", "2"],
    "ppo": ["--enable_test_mode", "--test_stop_step", "2"],
}
_LENGTHS = {"sft": {"--max_seq_len": "32"}, "reward": {"--max_seq_len": "32"}}
_LENGTHS["ppo"] = {"--max_answer_seq_len": "8", "--max_prompt_seq_len": "12"}
_BY_PATH = {s.path: s for s in SCRIPTS}
_RUN = [s.path for s in SCRIPTS if s.path not in SHARED_RUNS]


def step_args(script: Script, actor: str, critic: str, out: str) -> list[str]:
    """``main.py``'s arguments with the values the module docstring lists replaced (by flag)."""
    value_of = {
        "--model_name_or_path": actor,
        "--actor_model_name_or_path": actor,
        "--critic_model_name_or_path": critic,
        "--output_dir": out,
        "--tensorboard_path": out,
        "--inference_tp_size": None,  # min(value, 2)
        **{flag: "layers." for flag in ("--lora_module_name", "--actor_lora_module_name", "--critic_lora_module_name")},
        **_LENGTHS[script.step],
    }
    args = script.main_args()
    out_args: list[str] = []
    for i, arg in enumerate(args):
        prev = args[i - 1] if i else ""
        if prev in value_of:
            out_args.append(str(min(int(arg), 2)) if value_of[prev] is None else str(value_of[prev]))
        else:
            out_args.append(arg)
    missing = {**_LENGTHS[script.step], **_lora_targets(args)}
    return out_args + [x for flag, v in missing.items() if flag not in args for x in (flag, v)]


def _lora_targets(argv: list[str]) -> dict[str, str]:
    """A LoRA flag the script turns on without its module name gets one (DS-Chat's default "decoder.layers." names
    OPT's blocks; the tiny stand-in model is a Llama, whose blocks are "model.layers.")."""
    pairs = {
        "--lora_dim": "--lora_module_name",
        "--actor_lora_dim": "--actor_lora_module_name",
        "--critic_lora_dim": "--critic_lora_module_name",
    }
    return {target: "layers." for flag, target in pairs.items() if flag in argv}


def _flags(script: Script) -> set[str]:
    return {a for a in step_args(script, "m", "c", "o") if a.startswith("--")}


def write_fixtures(root: Path) -> None:
    """Small local copies of the datasets the scripts name (their own schemas), digits the demo tokenizer knows."""

    def digits(i: int) -> str:
        return " ".join(str((i + k) % 10) for k in range(3))

    rows = {
        "Dahoas/rm-static": [
            {
                "prompt": f"{digits(i)} =",
                "chosen": " " + digits(i)[::-1],
                "rejected": " " + digits(i),
                "response": " " + digits(i)[::-1],
            }
            for i in range(2800)  # step 1 of opt/single_gpu/run_1.3b.sh: two global batches of 16 x 2 x 8 = 256
        ],
        "Dahoas/full-hh-rlhf": [
            {"prompt": f"{digits(i)} =", "chosen": " 1", "rejected": " 2", "response": " 1"} for i in range(40)
        ],
        "Dahoas/synthetic-instruct-gptj-pairwise": [
            {"prompt": digits(i), "chosen": "3", "rejected": "4"} for i in range(40)
        ],
        "yitingxie/rlhf-reward-datasets": [
            {"prompt": f"Human: {digits(i)} ", "chosen": "Assistant: 5", "rejected": "Assistant: 6"} for i in range(40)
        ],
        "wangrui6/Zhihu-KOL": [{"INSTRUCTION": digits(i), "RESPONSE": digits(i + 1)} for i in range(20)],
        "Cohere/miracl-zh-queries-22-12": [
            {"query": digits(i), "positive_passages": [{"text": digits(i + 2)}], "negative_passages": [{"text": "0"}]}
            for i in range(20)
        ],
        "Hello-SimpleAI/HC3-Chinese": [{"question": digits(i), "human_answers": [digits(i + 3)]} for i in range(20)],
        "mkqa": [
            {
                "queries": {"zh_cn": digits(i), "ja": digits(i)},
                "answers": {"zh_cn": [{"text": digits(i + 4)}], "ja": [{"text": "1"}]},
            }
            for i in range(20)
        ],
        "Cohere/miracl-ja-queries-22-12": [
            {"query": digits(i), "positive_passages": [{"text": digits(i + 5)}], "negative_passages": [{"text": "0"}]}
            for i in range(20)
        ],
        "lmqg/qg_jaquad": [{"question": digits(i), "sentence": digits(i + 6)} for i in range(20)],
        "lmqg/qag_jaquad": [{"questions": [digits(i)], "paragraph": digits(i + 7)} for i in range(20)],
    }
    for folder, items in rows.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))


def test_the_28_scripts_and_the_shared_runs() -> None:
    """28 distinct scripts (12 of step 1, 5 of step 2, 11 of step 3); a script that shares another's run has
    exactly its flags (after the substitutions) and the same step."""
    assert len(_BY_PATH) == len(SCRIPTS) == 28
    assert [sum(s.step == step for s in SCRIPTS) for step in ("sft", "reward", "ppo")] == [12, 5, 11]
    for path, runner in SHARED_RUNS.items():
        shared, ran = _BY_PATH[path], _BY_PATH[runner]
        assert runner not in SHARED_RUNS and shared.step == ran.step
        assert _flags(shared) == _flags(ran), (path, _flags(shared) ^ _flags(ran))


@pytest.mark.parametrize("path", list(_BY_PATH))
def test_script_arguments_parse(path: str) -> None:
    """Every script's launcher flags and ``main.py`` arguments parse (the latter into settings)."""
    script = _BY_PATH[path]
    spec, step, rest = parse_launch([*script.launcher_flags(), script.step, "--x"])
    assert (step, rest) == (script.step, ["--x"]) and spec.bind_cores == ("--bind_cores_to_rank" in script.line)
    args = build_parser().parse_args([script.step, *script.main_args()])
    s = settings_from_args(_MODELS[script.step], args)
    assert s.dtype == "fp16" and s.output_dir.startswith("$OUTPUT")  # DeepSpeed-Chat's default dtype; the script's


@pytest.mark.slow
@pytest.mark.parametrize("path", _RUN)
def test_script_runs_at_world_2(path: str, tmp_path: Path) -> None:
    script = _BY_PATH[path]
    actor, value = make_model_dirs(tmp_path / "models")
    data = tmp_path / "data"
    write_fixtures(data)
    out = tmp_path / "out"
    kept = [f for f in script.launcher_flags() if f == "--bind_cores_to_rank"]
    cmd = [sys.executable, "-m", "hybridzero", "launch", "--num_gpus", "2", *kept, script.step]
    cmd += [*step_args(script, actor, value, str(out)), *_STOP[script.step], "--progress", "false"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HYBRIDZERO_TIMEOUT_S": "200",
        "HYBRIDZERO_DATA_ROOT": str(data),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["phase"] in ("sft", "reward", "ppo")]
    assert steps == [1, 2], steps
    model_dir = out / "actor" if script.step == "ppo" else out
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and (model_dir / "tokenizer_config.json").is_file()


def test_relaunch_keeps_torchrun_off_our_flags(tmp_path: Path) -> None:
    """``--monitor`` once made torchrun stop with "ambiguous option"; now the ranks start and fail on our own
    one-line model check instead."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    missing = str(tmp_path / "no_actor")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridzero",
            "grpo",
            "--world_size",
            "2",
            "--monitor",
            "none",
            "--actor_model_name_or_path",
            missing,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert "ambiguous option" not in proc.stderr
    assert f"grpo: error: --actor_model_name_or_path {missing!r}: no such directory" in proc.stderr
    assert proc.returncode != 0
