"""DeepSpeed-Chat compatibility: its datasets by name from local copies (one fixture per schema, no downloads), its
defaults, its schedules and weight-decay groups, the launcher, and one-line model load errors."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from hybridzero.cli import build_parser, main
from hybridzero.launch import LaunchSpec, parse_launch, torchrun_command
from hybridzero.rlhf.cli import settings_from_args
from hybridzero.rlhf.data.dealing import make_plan
from hybridzero.rlhf.data.dschat import DSCHAT_DATASETS, dschat_rows
from hybridzero.rlhf.data.ptx import unsupervised_records
from hybridzero.rlhf.data.records import phase_records, phase_train_eval, whole_records
from hybridzero.rlhf.engines import OptimSpec, decay_groups, hf_scheduler
from hybridzero.rlhf.models import ModelLoadError, check_loadable
from hybridzero.rlhf.settings import (
    HF_SCHEDULES,
    PPOSettings,
    RewardSettings,
    SFTSettings,
)

# one raw row per schema, and what DeepSpeed-Chat's class extracts from it: (prompt, chosen, rejected)
SCHEMAS: dict[str, tuple[dict[str, Any], tuple[str, str, str | None]]] = {
    "Dahoas/rm-static": (
        {"prompt": " Human: hi Assistant:", "chosen": " yes", "rejected": " no", "response": " x"},
        (" Human: hi Assistant:", " yes", " no"),
    ),
    "Dahoas/full-hh-rlhf": ({"prompt": "P", "chosen": "C", "rejected": "R", "response": "C"}, ("P", "C", "R")),
    "Dahoas/synthetic-instruct-gptj-pairwise": (
        {"prompt": "q", "chosen": "a", "rejected": "b"},
        (" Human: q Assistant:", " a", " b"),
    ),
    "yitingxie/rlhf-reward-datasets": (
        {"prompt": "Human: q ", "chosen": "Assistant: good", "rejected": "Assistant: bad"},
        ("Human: q Assistant:", " good", " bad"),
    ),
    "openai/webgpt_comparisons": (
        {
            "question": {"full_text": "why?"},
            "answer_0": "because [1] so",
            "answer_1": "no (2)idea",
            "score_0": -1.0,
            "score_1": 1.0,
        },
        (" Human: why? Assistant:", " noidea", " because so"),
    ),
    "stanfordnlp/SHP": (
        {"history": "h", "human_ref_A": "A", "human_ref_B": "B", "labels": 0},
        (" Human: h Assistant:", " B", " A"),
    ),
    "pvduy/sharegpt_alpaca_oa_vicuna_format": (
        {"prompt": "USER: hi ASSISTANT:", "label": "hello"},
        ("Human: hi Assistant:", " hello", None),
    ),
    "wangrui6/Zhihu-KOL": ({"INSTRUCTION": "问", "RESPONSE": "答"}, (" Human: 问 Assistant:", " 答", None)),
    "Cohere/miracl-zh-queries-22-12": (
        {"query": "q", "positive_passages": [{"text": "p"}], "negative_passages": [{"text": "n"}]},
        (" Human: q Assistant:", " p", " n"),
    ),
    "Hello-SimpleAI/HC3-Chinese": ({"question": "q", "human_answers": ["h"]}, (" Human: q Assistant:", " h", None)),
    "mkqa-Chinese": (
        {"queries": {"zh_cn": "中", "ja": "日"}, "answers": {"zh_cn": [{"text": "甲"}], "ja": [{"text": "乙"}]}},
        (" Human: 中 Assistant:", " 甲", None),
    ),
    "mkqa-Japanese": (
        {"queries": {"zh_cn": "中", "ja": "日"}, "answers": {"zh_cn": [{"text": "甲"}], "ja": [{"text": "乙"}]}},
        (" Human: 日 Assistant:", " 乙", None),
    ),
    "Cohere/miracl-ja-queries-22-12": (
        {"query": "q", "positive_passages": [{"text": "p"}], "negative_passages": [{"text": "n"}]},
        (" Human: q Assistant:", " p", " n"),
    ),
    "lmqg/qg_jaquad": ({"question": "q", "sentence": "s"}, (" Human: q Assistant:", " s", None)),
    "lmqg/qag_jaquad": ({"questions": ["q1", "q2"], "paragraph": "p"}, (" Human: q1 Assistant:", " p", None)),
    "local/jsonfile": ({"prompt": "p", "chosen": "c", "rejected": "r"}, (" p", " c", " r")),
}


def _write_copy(root: Path, name: str, rows: list[dict[str, Any]], saved: bool = False) -> None:
    """A local copy of ``name`` under ``root``: ``save_to_disk`` (``saved``) or ``train.jsonl``."""
    folder = root / DSCHAT_DATASETS[name].folder
    folder.mkdir(parents=True, exist_ok=True)
    if saved:
        datasets = pytest.importorskip("datasets")
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(folder))
    elif name == "local/jsonfile":
        (folder / "train.json").write_text(json.dumps(rows))
    else:
        (folder / "train.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def test_every_deepspeed_chat_dataset_name_has_an_adapter() -> None:
    assert set(SCHEMAS) == set(DSCHAT_DATASETS)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_adapter_extracts_as_deepspeed_chat(name: str, tmp_path: Path) -> None:
    row, (prompt, chosen, rejected) = SCHEMAS[name]
    _write_copy(tmp_path, name, [row] * 3)
    rows = dschat_rows(name, str(tmp_path))
    assert rows is not None and len(rows) == 3
    want = {"prompt": prompt, "chosen": chosen} | ({"rejected": rejected} if rejected is not None else {})
    assert rows[0] == want


@pytest.mark.parametrize("name", ["Dahoas/rm-static", "openai/webgpt_comparisons", "mkqa-Chinese"])
def test_save_to_disk_copies_read_like_jsonl(name: str, tmp_path: Path) -> None:
    row, _ = SCHEMAS[name]
    _write_copy(tmp_path / "jsonl", name, [row] * 2)
    _write_copy(tmp_path / "saved", name, [row] * 2, saved=True)
    assert dschat_rows(name, str(tmp_path / "saved")) == dschat_rows(name, str(tmp_path / "jsonl"))
    # a path that ends with the name uses the name's adapter
    assert (
        dschat_rows(str(tmp_path / "saved" / DSCHAT_DATASETS[name].folder), None)
        == dschat_rows(name, str(tmp_path / "jsonl"))
        or name == "mkqa-Chinese"
    )


def test_phases_of_a_named_dataset_are_disjoint_and_step2_needs_rejected(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(20)]
    _write_copy(tmp_path, "Dahoas/rm-static", rows)
    got = [phase_records(["Dahoas/rm-static"], "2,4,4", p, None, 7, str(tmp_path)) for p in (1, 2, 3)]
    assert [len(g) for g in got] == [4, 8, 8]
    assert len({r["prompt"] for g in got for r in g}) == 20
    _write_copy(tmp_path, "wangrui6/Zhihu-KOL", [{"INSTRUCTION": f"q{i}", "RESPONSE": "a"} for i in range(6)])
    sft = phase_records(["wangrui6/Zhihu-KOL"], "10,0,0", 1, None, 7, str(tmp_path))
    assert sft[0] == {"prompt": sft[0]["prompt"], "response": " a"} and len(sft) == 6
    with pytest.raises(ValueError, match="no record of its step-2 share has a rejected answer"):
        phase_records(["wangrui6/Zhihu-KOL"], "1,1,1", 2, ("prompt", "chosen", "rejected"), 7, str(tmp_path))


def test_missing_local_copy_names_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"Dahoas/full-hh-rlhf: no local copy \(looked for .*Dahoas/full-hh"):
        dschat_rows("Dahoas/full-hh-rlhf", str(tmp_path))
    assert dschat_rows("some/other-set", str(tmp_path)) is None


def test_ptx_text_rows_from_name_and_config(tmp_path: Path) -> None:
    folder = tmp_path / "wikitext" / "wikitext-2-raw-v1"
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text('{"text": "a b"}\n{"text": ""}\n{"text": "c"}\n')
    assert unsupervised_records("wikitext", "wikitext-2-raw-v1", str(tmp_path)) == [("", "a b"), ("", "c")]
    assert not PPOSettings(unsupervised_dataset_name="wikitext").ptx_enabled
    assert PPOSettings(unsupervised_dataset_name="w", unsupervised_dataset_config_name="c").ptx_enabled


def test_defaults_are_deepspeed_chats() -> None:
    sft, rm, ppo = SFTSettings(), RewardSettings(), PPOSettings()
    for s in (sft, rm, ppo):
        assert (s.dtype, s.data_path, s.data_split, s.enable_tensorboard, s.lr_scheduler_type, s.seed) == (
            "fp16",
            ["Dahoas/rm-static"],
            "2,4,4",
            False,
            "cosine",
            1234,
        )
    assert (sft.learning_rate, sft.weight_decay, sft.zero_stage, sft.num_warmup_steps) == (1e-3, 0.0, 0, 0)
    assert (rm.learning_rate, rm.zero_stage, sft.eot_token) == (5e-5, 0, "<|endoftext|>")
    assert (ppo.actor_learning_rate, ppo.critic_learning_rate, ppo.num_warmup_steps) == (9.65e-6, 5e-6, 100)
    assert (ppo.actor_zero_stage, ppo.stage_of("reference"), ppo.stage_of("reward")) == (0, 0, 0)
    assert PPOSettings(actor_zero_stage=3, critic_zero_stage=2).stage_of("reward") == 2


@pytest.mark.parametrize("name", HF_SCHEDULES)
def test_schedules_follow_transformers_curves(name: str) -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], lr=1e-3)
    factory = hf_scheduler(OptimSpec(1e-3, 0.0, name, 3, 11))
    assert factory is not None
    ours = factory(opt)
    ref_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    ref = transformers.get_scheduler(name, ref_opt, num_warmup_steps=3, num_training_steps=11)
    lrs = []
    for _ in range(11):
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        lrs.append(opt.param_groups[0]["lr"])
        opt.step(), ours.step(), ref_opt.step(), ref.step()
    assert (lrs[0] == 0.0 or name == "constant") and math.isclose(lrs[3], 1e-3)
    if name == "cosine":  # decays to 0, not to 10%
        assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    assert hf_scheduler(OptimSpec(1e-3, 0.0, "warmup_cosine", 3, 11)) is None


def test_weight_decay_skips_biases_and_norms() -> None:
    config = transformers.LlamaConfig(
        vocab_size=37,
        hidden_size=12,
        intermediate_size=20,
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=3,
        attention_bias=True,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert decay_groups(model, 0.0) is None
    decayed, plain = decay_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    plain_names = sorted(names[id(p)] for p in plain["params"])
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)
    assert all(n.endswith("bias") or "norm.weight" in n for n in plain_names)
    assert "model.norm.weight" in plain_names and "model.layers.0.self_attn.q_proj.bias" in plain_names
    assert "model.layers.0.self_attn.q_proj.weight" in {names[id(p)] for p in decayed["params"]}


def test_launcher_maps_deepspeed_flags_onto_torchrun() -> None:
    spec, step, rest = parse_launch(["--num_gpus", "2", "--master_port", "12346", "step3", "--monitor", "none"])
    assert (spec, step, rest) == (LaunchSpec(2, master_port=12346), "ppo", ["--monitor", "none"])
    cmd = torchrun_command(spec, step, rest)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[cmd.index("hybridzero") + 1 :] == ["--", "ppo", "--monitor", "none"]
    assert "--standalone" in torchrun_command(LaunchSpec(1), "sft", [])
    for argv, match in (
        (["--hostfile", "h", "sft"], "--hostfile is not supported"),
        (["--num_gpus", "x", "sft"], "--num_gpus 'x': expected an integer"),
        (["--num_gpus", "2", "main.py"], "STEP 'main.py' is not one of"),
        (["--bogus", "1", "sft"], "unknown launcher flag '--bogus'"),
        (["--bind_core_list", "0-x", "sft"], "--bind_core_list '0-x': expected core numbers and ranges"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_launch(argv)


def test_bind_cores_to_rank_gives_each_rank_its_core_share() -> None:
    """DeepSpeed's ``--bind_cores_to_rank`` (DeepSpeed-Chat's scripts pass it): each local rank's OMP_NUM_THREADS is
    its share of the cores, or of ``--bind_core_list``'s; at least one."""
    spec, step, rest = parse_launch(["--num_gpus", "3", "--bind_cores_to_rank", "reward", "--offload"])
    assert (spec.bind_cores, spec.procs, step, rest) == (True, 3, "reward", ["--offload"])
    assert (spec.threads_per_rank(16), spec.threads_per_rank(2)) == (5, 1)
    spec, _, _ = parse_launch(["--bind_cores_to_rank", "--bind_core_list", "0-3,8", "--num_gpus", "2", "sft"])
    assert spec.core_list == "0-3,8" and spec.threads_per_rank(64) == 2
    assert not parse_launch(["sft"])[0].bind_cores


def test_unloadable_models_end_in_one_line_naming_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match=r"--model_name_or_path '.*nowhere': no such directory"):
        check_loadable(str(tmp_path / "nowhere"), "--model_name_or_path")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        check_loadable(str(tmp_path / "empty"), "--model_name_or_path")
    with pytest.raises(
        ModelLoadError, match=r"'no-such-org/no-such-model': not a local directory, and cannot be loaded \(offline"
    ):
        check_loadable("no-such-org/no-such-model", "--actor_model_name_or_path")
    t5 = tmp_path / "t5"
    transformers.T5Config(vocab_size=11, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2).save_pretrained(t5)
    (t5 / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is not a causal LM"):
        check_loadable(str(t5), "--model_name_or_path")


def test_cli_model_error_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = str(tmp_path / "no_model")
    assert main(["sft", "--model_name_or_path", missing, "--progress", "false"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"sft: error: --model_name_or_path {missing!r}: no such directory"]
    with pytest.raises(ModelLoadError):
        main(["ppo", "--actor_model_name_or_path", missing, "--debug"])


def test_test_mode_counts_generation_batches_and_keeps_the_schedule_horizon() -> None:
    base = {"per_device_generation_batch_size": 2, "per_device_training_batch_size": 2, "generation_batches": 2}
    full = make_plan(PPOSettings(**base), world=2, n_prompts=40)  # 8 prompts per iteration: 5 iterations
    assert (full.total_iterations, full.schedule_iterations) == (5, 5)
    three = make_plan(PPOSettings(**base, enable_test_mode=True, test_stop_step=3), world=2, n_prompts=40)
    assert (three.total_iterations, three.schedule_iterations) == (2, 5)  # 3 generation batches: 2 iterations
    assert make_plan(PPOSettings(**base, test_stop_step=3), world=2, n_prompts=40).total_iterations == 5  # off
    one_epoch = make_plan(PPOSettings(**base, enable_test_mode=True, num_train_epochs=3), world=2, n_prompts=40)
    assert one_epoch.total_iterations == 5 and one_epoch.schedule_iterations == 15


def test_sft_only_data_is_used_whole(tmp_path: Path) -> None:
    _write_copy(tmp_path, "lmqg/qg_jaquad", [{"question": f"q{i}", "sentence": "s"} for i in range(5)])
    rows = whole_records(["lmqg/qg_jaquad"], str(tmp_path))
    assert len(rows) == 5 and rows[0] == {"prompt": " Human: q0 Assistant:", "response": " s"}
    s = SFTSettings(sft_only_data_path=["lmqg/qg_jaquad"], print_loss=True)
    assert s.sft_only_data_path == ["lmqg/qg_jaquad"] and s.print_loss


@pytest.mark.parametrize("schedule", HF_SCHEDULES)
def test_deepspeed_chat_launcher_and_config_flags_are_accepted(schedule: str) -> None:
    argv = [
        "sft",
        "--deepspeed",
        "--deepspeed_config",
        "ds.json",
        "--deepscale",
        "--deepscale_config",
        "ds.json",
        "--disable_dropout",
        "--eot_token",
        "<|im_end|>",
        "--print_loss",
        "--sft_only_data_path",
        "a",
        "b",
        "--lr_scheduler_type",
        schedule,
        "--local_rank",
        "0",
        "--data_root",
        "/data",
    ]
    s = settings_from_args(SFTSettings, build_parser().parse_args(argv))
    assert isinstance(s, SFTSettings)
    assert (s.eot_token, s.print_loss, s.sft_only_data_path, s.lr_scheduler_type, s.data_root) == (
        "<|im_end|>",
        True,
        ["a", "b"],
        schedule,
        "/data",
    )


@pytest.mark.parametrize("saved", [False, True])
def test_evaluation_uses_a_datasets_own_test_split(tmp_path: Path, saved: bool) -> None:
    """As DeepSpeed-Chat: a copy with a test split is evaluated on that split's share of the phase (and trained on
    its whole train share); a copy without one holds out eval_fraction of the phase share."""
    rows = [{"prompt": f"P{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(40)]
    test = [{"prompt": f"T{i}", "chosen": f"tc{i}", "rejected": f"tr{i}"} for i in range(20)]
    folder = tmp_path / DSCHAT_DATASETS["Dahoas/rm-static"].folder
    folder.mkdir(parents=True)
    if saved:
        datasets = pytest.importorskip("datasets")
        parts = {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(test)}
        datasets.DatasetDict(parts).save_to_disk(str(folder))
    else:
        for name, part in (("train.jsonl", rows), ("test.jsonl", test)):
            (folder / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    _write_copy(
        tmp_path,
        "Dahoas/synthetic-instruct-gptj-pairwise",
        [{"prompt": f"G{i}", "chosen": f"gc{i}", "rejected": f"gr{i}"} for i in range(40)],
    )
    names = ["Dahoas/rm-static", "Dahoas/synthetic-instruct-gptj-pairwise"]
    train, evals = phase_train_eval(names, "2,4,4", 2, None, 1234, str(tmp_path), 0.25)
    share = phase_records(names[:1], "2,4,4", 2, None, 1234, str(tmp_path))
    assert len(share) == 16 and all(r in train for r in share)  # rm-static: its whole train share is trained on
    from_test = [r for r in evals if r["prompt"].startswith("T")]
    assert len(from_test) == 8 and not any(r["prompt"].startswith("P") for r in evals)  # 4/10 of the 20 test rows
    gptj_train = [r for r in train if "G" in r["prompt"]]
    gptj_eval = [r for r in evals if "G" in r["prompt"]]
    assert (len(gptj_train), len(gptj_eval)) == (12, 4)  # no test split: eval_fraction 0.25 of its 16-row share
    assert len(evals) == len(from_test) + len(gptj_eval)
    assert not any(r in train for r in evals)
