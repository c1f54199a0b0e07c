"""DeepSpeed-Chat's own training code (steps 1 -> 2 -> 3) on hybridzero at world 2 on CPU.

The code under ``tests/third_party/dschat`` is DeepSpeed-Chat's, changed only in its import lines (its README lists
them). Each step runs as DeepSpeed's launcher runs it: ``torchrun --nproc_per_node 2`` with ``--local_rank=N`` per
process. The model is a tiny OPT (DeepSpeed-Chat's default family) with the byte-level ByT5 tokenizer (built without
files, so DeepSpeed-Chat's ``save_hf_format`` + reload round-trips under transformers 5); the data is
``local/jsonfile`` (``data/{train,eval}.json`` beside ``dschat/``, so the copy is laid out in a temporary folder) on
a memorizable copy task. Every step runs ZeRO-3: steps 1 and 2 save through DeepSpeed-Chat's own
``save_zero_three_model`` (it reads the ``ds_id`` / ``ds_status`` properties of hybridzero's ``ZeroParameter``; the
saved files are checked whole), step 3 trains all four models with bf16, as DeepSpeed-Chat's CPU dtype, and
``--enable_hybrid_engine`` (its ``actor_model.module.generate(...,
synced_gpus=True)`` is HF's synced generation over the ZeRO-3 hooks; ``engine.generate`` is the gather-once path).

Environment for the runs: ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` because DeepSpeed-Chat ``torch.load``s the dataset
objects it cached itself, which torch >= 2.6 refuses by default (not a hybridzero matter).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

COPY = Path(__file__).resolve().parents[1] / "third_party" / "dschat"
LETTERS = "abcde"
OTHER = str.maketrans(LETTERS, "vwxyz")
# per-rank wrapper: DeepSpeed's launcher passes --local_rank=N to each process; torchrun exports LOCAL_RANK
NUM = r"(-?[0-9.]+(?:e[-+]?[0-9]+)?)"  # a printed float
WRAPPER = 'exec "$0" "$1" --local_rank="$LOCAL_RANK" "${@:2}"'


def _examples(n: int, rng: random.Random) -> list[dict[str, str]]:
    """Copy task: ``copy xyz =</s>`` -> ``xyz`` (chosen) / the word in other letters (rejected). The prompt ends
    with ``</s>`` because ByT5 appends it to every encoding (so step 3's prompts end with it): the SFT data must
    teach what follows it. As with OPT's leading ``</s>``, one pad-equal token precedes the text's end, hence
    ``--num_padding_at_beginning 1`` (DeepSpeed-Chat's default)."""
    out = []
    while len(out) < n:
        word = "".join(rng.choice(LETTERS) for _ in range(3))
        out.append({"prompt": f"copy {word} =</s>", "chosen": word, "rejected": word.translate(OTHER)})
    return out


def _layout(root: Path) -> tuple[Path, Path]:
    """The DeepSpeed-Chat copy with its ``data/`` and a tiny OPT base model; returns ``(chat_root, model_dir)``."""
    import torch
    import transformers

    chat = root / "DeepSpeed-Chat"
    shutil.copytree(COPY, chat)
    rng = random.Random(0)
    (chat / "data").mkdir()
    (chat / "data" / "train.json").write_text(json.dumps(_examples(48, rng)))
    (chat / "data" / "eval.json").write_text(json.dumps(_examples(12, rng)))
    config = transformers.OPTConfig(
        vocab_size=384, hidden_size=104, num_hidden_layers=2, ffn_dim=150, num_attention_heads=4,
        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, tokenizer_class="ByT5Tokenizer",
        pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model_dir = root / "opt-tiny"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    return chat, model_dir


def _run(chat: Path, script: str, args: list[str], log: Path) -> str:
    """``torchrun --nproc_per_node 2`` of one DeepSpeed-Chat ``main.py``; returns its output (raises on failure)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(chat), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--no-python",
           "bash", "-c", WRAPPER, sys.executable, str(chat / "training" / script / "main.py"), *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=chat, env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    log.write_text(out)
    assert proc.returncode == 0, f"{script} failed (rc {proc.returncode}):\n{out[-6000:]}"
    return out


def _floats(pattern: str, text: str) -> list[float]:
    return [float(m) for m in re.findall(pattern, text)]


def _assert_saved_whole(out_dir: Path, base: Path) -> None:
    """DeepSpeed-Chat's ZeRO-3 save (``save_zero_three_model``: ``ds_id`` / ``ds_status`` + ``GatheredParameters``)
    wrote every parameter whole: each base-model tensor is in ``pytorch_model.bin`` with its full shape, finite, and
    the training moved the weights away from the base model's."""
    import torch
    import transformers

    saved = torch.load(out_dir / "pytorch_model.bin", weights_only=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(base).state_dict()
    matched, moved = 0, 0
    for name, tensor in saved.items():
        stripped = name.split(".", 1)[-1]  # the reward model's trunk has its own prefix; its v_head matches nothing
        key = next((k for k in ref if k.endswith("." + name) or k == name), None)
        key = key or next((k for k in ref if "." in stripped and k.endswith("." + stripped)), None)
        assert tensor.numel() > 0 and (key is None or tensor.shape == ref[key].shape), (name, tuple(tensor.shape))
        assert bool(torch.isfinite(tensor.float()).all()), name
        matched += key is not None
        moved += key is not None and not torch.equal(tensor.float(), ref[key].float())
    assert matched >= len(saved) - 1, (matched, sorted(saved))  # only the reward model's v_head is its own
    assert moved > matched // 2, (moved, matched)
    assert len(saved) >= len({k for k in ref if "lm_head" not in k}) - 1, sorted(saved)


@pytest.mark.slow
def test_dschat_steps_1_2_3_run_unchanged_at_world_2(tmp_path: Path) -> None:
    chat, base = _layout(tmp_path)
    data = ["--data_path", "local/jsonfile", "--data_split", "1,1,1", "--data_output_path", str(tmp_path / "cache")]
    common = [*data, "--dtype", "bf16", "--seed", "1234", "--lr_scheduler_type", "constant", "--deepspeed"]

    out1 = _run(chat, "step1_supervised_finetuning", [
        *common, "--model_name_or_path", str(base), "--per_device_train_batch_size", "2",
        "--per_device_eval_batch_size", "2", "--max_seq_len", "24", "--learning_rate", "3e-3",
        "--num_train_epochs", "5", "--zero_stage", "3", "--print_loss", "--output_dir", str(tmp_path / "actor"),
    ], tmp_path / "step1.log")  # fmt: skip
    rank0 = _floats(r"Rank: 0, loss = " + NUM, out1)
    evals = _floats(r"ppl: \S+, loss: " + NUM, out1)
    assert len(rank0) == 20 and len(evals) == 6, (rank0, evals)
    assert sum(rank0[-4:]) < 0.8 * sum(rank0[:4]), rank0  # the copy task is memorized: the loss falls clearly
    assert evals[-1] < evals[0], evals
    _assert_saved_whole(tmp_path / "actor", base)

    out2 = _run(chat, "step2_reward_model_finetuning", [
        *common, "--model_name_or_path", str(base), "--per_device_train_batch_size", "2",
        "--per_device_eval_batch_size", "2", "--max_seq_len", "40", "--learning_rate", "5e-3",
        "--num_train_epochs", "4", "--zero_stage", "3", "--num_padding_at_beginning", "1",
        "--output_dir", str(tmp_path / "critic"),
    ], tmp_path / "step2.log")  # fmt: skip
    losses = _floats(r"Epoch \d+/\d+ with loss " + NUM, out2)
    accs = _floats(r"acc \(higher is better\) : " + NUM, out2)
    rejected = _floats(r"rejected_last_scores \(lower is better\) : " + NUM, out2)
    chosen = _floats(r"chosen_last_scores \(higher is better\) : " + NUM, out2)
    assert len(losses) == 4 and len(accs) == len(chosen) == len(rejected) == 5, (losses, accs, chosen)
    assert losses[-1] < 0.5 * losses[0], losses  # the rejected answers use other letters: easily separated
    assert chosen[-1] - rejected[-1] > chosen[0] - rejected[0] + 1.0, (chosen, rejected)
    assert accs[-1] == 1.0, accs
    _assert_saved_whole(tmp_path / "critic", base)

    out3 = _run(chat, "step3_rlhf_finetuning", [
        *common, "--actor_model_name_or_path", str(tmp_path / "actor"),
        "--critic_model_name_or_path", str(tmp_path / "critic"), "--num_padding_at_beginning", "1",
        "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2",
        "--max_prompt_seq_len", "20", "--max_answer_seq_len", "6", "--actor_learning_rate", "1e-4",
        "--critic_learning_rate", "1e-4", "--actor_zero_stage", "3", "--critic_zero_stage", "3",
        "--num_warmup_steps", "0", "--enable_test_mode", "--test_stop_step", "3", "--print_answers",
        "--enable_hybrid_engine",
    ], tmp_path / "step3.log")  # fmt: skip
    answers = re.findall(r"--- ans    --> step=\d+, rank=\d+, (\[.*\])", out3)
    assert len(answers) == 6, out3[-3000:]  # 3 steps x 2 ranks
    assert all(a not in ("[]", "['']", "['', '']") for a in answers), answers
    actor = _floats(r"Actor Loss: " + NUM, out3)
    critic = _floats(r"Critic Loss: " + NUM, out3)
    assert len(actor) == 3 and len(critic) == 3, (actor, critic)
    assert all(abs(x) < 1e3 for x in actor + critic), (actor, critic)
    assert "Average reward score" in out3
