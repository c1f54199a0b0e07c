"""DeepSpeed-Chat's own launch scripts through ``hybridzero launch --num_gpus 2`` at world 2.

Each entry is the argument list of one ``training_scripts/**/*.sh`` of DeepSpeed-Chat, flags and values exactly as
the script passes them, except: model paths are tiny local models, sequence lengths are shrunk, ``$OUTPUT`` is a
temporary folder, and the DeepSpeed-Chat dataset names resolve to small fixtures in every schema through
``$HYBRIDZERO_DATA_ROOT`` (no download). For CI cost each run appends a stop (``--max_steps 2`` for steps 1-2,
``--enable_test_mode --test_stop_step 2`` for step 3) and ``--progress false``.

Every entry parses (fast test); the runs are slow tests.

Long because it holds the scripts' argument lists as data (one entry per DeepSpeed-Chat script); the test code
itself is short.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridzero.cli import build_parser
from hybridzero.rlhf.cli import settings_from_args
from hybridzero.rlhf.settings import PPOSettings, RewardSettings, SFTSettings
from tests.workers.rlhf_runs import make_model_dirs

SFT_MODEL, RM_MODEL, ACTOR, CRITIC, OUT = "$SFT_MODEL", "$RM_MODEL", "$ACTOR", "$CRITIC", "$OUTPUT"

# (script, step, argv as the script passes it, with paths and lengths substituted)
SCRIPTS: list[tuple[str, str, list[str]]] = [
    (
        "step1 opt/single_gpu/run_1.3b.sh",
        "sft",
        [
            "--model_name_or_path",
            SFT_MODEL,
            "--gradient_accumulation_steps",
            "8",
            "--lora_dim",
            "128",
            "--zero_stage",
            "0",
            "--enable_tensorboard",
            "--tensorboard_path",
            OUT,
            "--deepspeed",
            "--output_dir",
            OUT,
            "--max_seq_len",
            "32",
        ],
    ),
    (
        "step1 other_language/run_chinese.sh",
        "sft",
        [
            "--data_path",
            "wangrui6/Zhihu-KOL",
            "Cohere/miracl-zh-queries-22-12",
            "Hello-SimpleAI/HC3-Chinese",
            "mkqa-Chinese",
            "--data_split",
            "10,0,0",
            "--model_name_or_path",
            SFT_MODEL,
            "--per_device_train_batch_size",
            "8",
            "--per_device_eval_batch_size",
            "8",
            "--max_seq_len",
            "32",
            "--learning_rate",
            "9.65e-6",
            "--weight_decay",
            "0.",
            "--num_train_epochs",
            "16",
            "--gradient_accumulation_steps",
            "1",
            "--lr_scheduler_type",
            "cosine",
            "--num_warmup_steps",
            "0",
            "--seed",
            "1234",
            "--zero_stage",
            "2",
            "--deepspeed",
            "--output_dir",
            OUT,
        ],
    ),
    (
        "step1 single_node/run_1.3b.sh",
        "sft",
        [
            "--data_path",
            "Dahoas/rm-static",
            "Dahoas/full-hh-rlhf",
            "Dahoas/synthetic-instruct-gptj-pairwise",
            "yitingxie/rlhf-reward-datasets",
            "--data_split",
            "2,4,4",
            "--model_name_or_path",
            SFT_MODEL,
            "--per_device_train_batch_size",
            "8",
            "--per_device_eval_batch_size",
            "8",
            "--max_seq_len",
            "32",
            "--learning_rate",
            "9.65e-6",
            "--weight_decay",
            "0.",
            "--num_train_epochs",
            "16",
            "--gradient_accumulation_steps",
            "1",
            "--lr_scheduler_type",
            "cosine",
            "--num_warmup_steps",
            "0",
            "--seed",
            "1234",
            "--zero_stage",
            "2",
            "--deepspeed",
            "--enable_tensorboard",
            "--tensorboard_path",
            OUT,
            "--output_dir",
            OUT,
        ],
    ),
    (
        "step2 opt/multi_node/run_350m.sh",
        "reward",
        [
            "--data_path",
            "Dahoas/rm-static",
            "Dahoas/full-hh-rlhf",
            "Dahoas/synthetic-instruct-gptj-pairwise",
            "yitingxie/rlhf-reward-datasets",
            "--data_split",
            "2,4,4",
            "--model_name_or_path",
            RM_MODEL,
            "--num_padding_at_beginning",
            "1",
            "--per_device_train_batch_size",
            "2",
            "--per_device_eval_batch_size",
            "2",
            "--max_seq_len",
            "32",
            "--learning_rate",
            "5e-5",
            "--weight_decay",
            "0.1",
            "--disable_dropout",
            "--num_train_epochs",
            "1",
            "--gradient_accumulation_steps",
            "1",
            "--lr_scheduler_type",
            "cosine",
            "--num_warmup_steps",
            "0",
            "--seed",
            "1234",
            "--zero_stage",
            "0",
            "--deepspeed",
            "--output_dir",
            OUT,
        ],
    ),
    (
        "step2 opt/single_gpu/run_350m.sh",
        "reward",
        [
            "--model_name_or_path",
            RM_MODEL,
            "--num_padding_at_beginning",
            "1",
            "--weight_decay",
            "0.1",
            "--disable_dropout",
            "--gradient_accumulation_steps",
            "4",
            "--zero_stage",
            "0",
            "--enable_tensorboard",
            "--tensorboard_path",
            OUT,
            "--deepspeed",
            "--output_dir",
            OUT,
            "--max_seq_len",
            "32",
        ],
    ),
    (
        "step3 opt/single_node/run_1.3b.sh",
        "ppo",
        [
            "--data_path",
            "Dahoas/rm-static",
            "--data_split",
            "2,4,4",
            "--actor_model_name_or_path",
            ACTOR,
            "--critic_model_name_or_path",
            CRITIC,
            "--num_padding_at_beginning",
            "1",
            "--per_device_generation_batch_size",
            "4",
            "--per_device_training_batch_size",
            "4",
            "--generation_batches",
            "1",
            "--ppo_epochs",
            "1",
            "--max_answer_seq_len",
            "8",
            "--max_prompt_seq_len",
            "12",
            "--actor_learning_rate",
            "9.65e-6",
            "--critic_learning_rate",
            "5e-6",
            "--num_train_epochs",
            "1",
            "--lr_scheduler_type",
            "cosine",
            "--gradient_accumulation_steps",
            "1",
            "--actor_dropout",
            "0.0",
            "--num_warmup_steps",
            "100",
            "--deepspeed",
            "--seed",
            "1234",
            "--enable_hybrid_engine",
            "--actor_zero_stage",
            "2",
            "--critic_zero_stage",
            "2",
            "--enable_ema",
            "--output_dir",
            OUT,
            "--enable_tensorboard",
            "--tensorboard_path",
            OUT,
        ],
    ),
    (
        "step3 opt/single_node/run_6.7b.sh",
        "ppo",
        [
            "--data_path",
            "Dahoas/rm-static",
            "--data_split",
            "2,4,4",
            "--actor_model_name_or_path",
            ACTOR,
            "--critic_model_name_or_path",
            CRITIC,
            "--num_padding_at_beginning",
            "1",
            "--per_device_generation_batch_size",
            "4",
            "--per_device_training_batch_size",
            "4",
            "--generation_batches",
            "1",
            "--ppo_epochs",
            "1",
            "--max_answer_seq_len",
            "8",
            "--max_prompt_seq_len",
            "12",
            "--actor_learning_rate",
            "9.65e-6",
            "--critic_learning_rate",
            "5e-6",
            "--actor_weight_decay",
            "0.1",
            "--critic_weight_decay",
            "0.1",
            "--num_train_epochs",
            "1",
            "--lr_scheduler_type",
            "cosine",
            "--gradient_accumulation_steps",
            "1",
            "--actor_gradient_checkpointing",
            "--actor_dropout",
            "0.0",
            "--num_warmup_steps",
            "100",
            "--deepspeed",
            "--seed",
            "1234",
            "--enable_hybrid_engine",
            "--actor_zero_stage",
            "3",
            "--critic_zero_stage",
            "3",
            "--output_dir",
            OUT,
        ],
    ),
    (
        "step3 opt/single_gpu/run_1.3b.sh",
        "ppo",
        [
            "--actor_model_name_or_path",
            ACTOR,
            "--critic_model_name_or_path",
            CRITIC,
            "--actor_zero_stage",
            "0",
            "--critic_zero_stage",
            "0",
            "--num_padding_at_beginning",
            "1",
            "--gradient_accumulation_steps",
            "2",
            "--deepspeed",
            "--actor_lora_dim",
            "128",
            "--enable_hybrid_engine",
            "--actor_gradient_checkpointing",
            "--actor_dropout",
            "0.0",
            "--output_dir",
            OUT,
            "--max_answer_seq_len",
            "8",
            "--max_prompt_seq_len",
            "12",
        ],
    ),
    (
        "step3 llama2/run_llama2_7b.sh",
        "ppo",
        [
            "--data_path",
            "Dahoas/rm-static",
            "--data_split",
            "2,4,4",
            "--actor_model_name_or_path",
            ACTOR,
            "--critic_model_name_or_path",
            CRITIC,
            "--num_padding_at_beginning",
            "1",
            "--per_device_generation_batch_size",
            "1",
            "--per_device_training_batch_size",
            "1",
            "--generation_batches",
            "1",
            "--ppo_epochs",
            "1",
            "--max_answer_seq_len",
            "8",
            "--max_prompt_seq_len",
            "12",
            "--actor_learning_rate",
            "9.65e-6",
            "--critic_learning_rate",
            "5e-6",
            "--actor_weight_decay",
            "0.1",
            "--critic_weight_decay",
            "0.1",
            "--num_train_epochs",
            "1",
            "--lr_scheduler_type",
            "cosine",
            "--gradient_accumulation_steps",
            "1",
            "--actor_gradient_checkpointing",
            "--critic_gradient_checkpointing",
            "--offload_reference_model",
            "--disable_actor_dropout",
            "--num_warmup_steps",
            "100",
            "--deepspeed",
            "--seed",
            "1234",
            "--actor_zero_stage",
            "3",
            "--critic_zero_stage",
            "3",
            "--enable_hybrid_engine",
            "--output_dir",
            OUT,
        ],
    ),
    (
        "step3 opt/single_node/run_13b.sh",
        "ppo",
        [
            "--data_path",
            "Dahoas/rm-static",
            "--data_split",
            "2,4,4",
            "--actor_model_name_or_path",
            ACTOR,
            "--critic_model_name_or_path",
            CRITIC,
            "--num_padding_at_beginning",
            "1",
            "--per_device_generation_batch_size",
            "16",
            "--per_device_training_batch_size",
            "16",
            "--generation_batches",
            "1",
            "--ppo_epochs",
            "1",
            "--max_answer_seq_len",
            "8",
            "--max_prompt_seq_len",
            "12",
            "--actor_learning_rate",
            "5e-4",
            "--critic_learning_rate",
            "5e-6",
            "--num_train_epochs",
            "1",
            "--lr_scheduler_type",
            "cosine",
            "--gradient_accumulation_steps",
            "1",
            "--num_warmup_steps",
            "100",
            "--deepspeed",
            "--seed",
            "1234",
            "--enable_hybrid_engine",
            "--inference_tp_size",
            "2",
            "--actor_zero_stage",
            "3",
            "--critic_zero_stage",
            "3",
            "--actor_gradient_checkpointing",
            "--disable_actor_dropout",
            "--actor_lora_dim",
            "128",
            "--actor_lora_module_name",
            "decoder.layers.",
            "--output_dir",
            OUT,
        ],
    ),
]
_MODELS = {"sft": SFTSettings, "reward": RewardSettings, "ppo": PPOSettings}
_STOP = {
    "sft": ["--max_steps", "2"],
    "reward": ["--max_steps", "2"],
    "ppo": ["--enable_test_mode", "--test_stop_step", "2"],
}
_IDS = [s[0] for s in SCRIPTS]


def _fill(argv: list[str], paths: dict[str, str]) -> list[str]:
    return [paths.get(a, a) for a in argv]


def _lora_targets(argv: list[str]) -> list[str]:
    """The OPT scripts' LoRA target, DS-Chat's default "decoder.layers.", names OPT's blocks; the tiny stand-in model
    is a Llama, whose blocks are "model.layers.": point each LoRA flag the script turns on at them (last one wins)."""
    pairs = {
        "--lora_dim": "--lora_module_name",
        "--actor_lora_dim": "--actor_lora_module_name",
        "--critic_lora_dim": "--critic_lora_module_name",
    }
    return [arg for flag, target in pairs.items() if flag in argv for arg in (target, "layers.")]


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
    }
    for folder, items in rows.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))


@pytest.mark.parametrize("script", _IDS)
def test_script_arguments_parse(script: str) -> None:
    """Every entry parses into settings."""
    _, step, argv = next(s for s in SCRIPTS if s[0] == script)
    paths = {SFT_MODEL: "m", RM_MODEL: "m", ACTOR: "a", CRITIC: "c", OUT: "out"}
    args = build_parser().parse_args([step, *_fill(argv, paths)])
    s = settings_from_args(_MODELS[step], args)
    assert s.dtype == "fp16" and s.output_dir == "out"  # DeepSpeed-Chat's default dtype; the script's output


@pytest.mark.slow
@pytest.mark.parametrize("script", _IDS)
def test_script_runs_at_world_2(script: str, tmp_path: Path) -> None:
    _, step, argv = next(s for s in SCRIPTS if s[0] == script)
    actor, value = make_model_dirs(tmp_path / "models")
    data = tmp_path / "data"
    write_fixtures(data)
    out = tmp_path / "out"
    paths = {SFT_MODEL: actor, RM_MODEL: actor, ACTOR: actor, CRITIC: value, OUT: str(out)}
    cmd = [
        sys.executable,
        "-m",
        "hybridzero",
        "launch",
        "--num_gpus",
        "2",
        step,
        *_fill(argv, paths),
        *_lora_targets(argv),
        *_STOP[step],
        "--progress",
        "false",
    ]
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
    model_dir = out / "actor" if step == "ppo" else out
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
