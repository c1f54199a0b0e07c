"""Steps 1 and 2 on gloo worlds, and the bad inputs every step must reject early with a clear message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.workers.rlhf_runs import make_model_dirs, reward_run, sft_run, step3_run


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_sft_then_reward_at_world_2(world, tmp_path: Path) -> None:
    """SFT from scratch on the demo data, then a reward model whose trunk starts from the SFT model; both write
    loadable Hugging Face directories, metrics.jsonl and TensorBoard events."""
    import transformers

    from hybridzero.rlhf.models import is_value_model_dir, load_value_model
    from hybridzero.rlhf.runlog.metrics import read_metrics

    pool = world(2)
    sft_dir, rm_dir = tmp_path / "sft", tmp_path / "rm"
    common = {
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 16,
        "max_seq_len": 24,
        "progress": False,
        "print_every": 1000,
        "eval_fraction": 0.02,
    }
    sft = pool.run(sft_run, dict(output_dir=str(sft_dir), max_steps=6, learning_rate=3e-3, **common))

    def same(m: dict[str, float]) -> dict[str, float]:  # step times are per rank; every other number is global
        return {k: v for k, v in m.items() if k != "step_time_s"}

    assert same(sft[0]) == same(sft[1])
    assert 0.0 < sft[0]["eval_loss"] < 5.0 and sft[0]["perplexity"] > 1.0
    model = transformers.AutoModelForCausalLM.from_pretrained(sft_dir)
    assert model.config.num_hidden_layers == 2
    rows = read_metrics(sft_dir)
    assert [r["step"] for r in rows if r["phase"] == "sft"] == [1, 2, 3, 4, 5, 6]
    assert list((sft_dir / "tensorboard").glob("events.out.tfevents.*"))

    rm = pool.run(
        reward_run,
        dict(output_dir=str(rm_dir), model_name_or_path=str(sft_dir), max_steps=4, learning_rate=1e-3, **common),
    )
    assert same(rm[0]) == same(rm[1])
    for key in ("accuracy", "eval_accuracy"):
        assert 0.0 <= rm[0][key] <= 1.0
    assert is_value_model_dir(rm_dir)
    value = load_value_model(rm_dir)
    trunk = {k: v for k, v in model.model.state_dict().items()}
    # the trunk moved away from the SFT weights by training, but has exactly its shapes
    assert {k: v.shape for k, v in value.transformer.state_dict().items()} == {k: v.shape for k, v in trunk.items()}
    ids = torch.tensor([[4, 5, 6, 14, 6, 5, 4, 2]])  # "0 1 2 = 2 1 0 </s>"
    assert value.score(ids, torch.ones_like(ids)).shape == (1,)


def test_bad_inputs_fail_early_with_the_reason(world, tmp_path: Path) -> None:
    pool = world(1)
    actor, value = make_model_dirs(tmp_path / "models")
    no_rejected = _write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "1 2 =", "chosen": "2 1"}] * 4)
    with pytest.raises(Exception, match=r"missing column\(s\) \['rejected'\]"):
        pool.run(
            reward_run,
            {
                "output_dir": str(tmp_path / "rm"),
                "model_name_or_path": actor,
                "data_path": [no_rejected],
                "data_split": "1,1,1",
                "progress": False,
            },
        )
    prompts = _write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "1 2 3 ="}] * 12)
    base = {
        "actor_model_name_or_path": actor,
        "critic_model_name_or_path": value,
        "output_dir": str(tmp_path / "ppo"),
        "per_device_generation_batch_size": 2,
        "per_device_training_batch_size": 2,
        "max_prompt_seq_len": 8,
        "max_answer_seq_len": 8,
        "progress": False,
        "resume": False,
        "max_steps": 1,
    }
    with pytest.raises(Exception, match="gives phase 3 no records"):
        pool.run(step3_run, dict(base, data_path=[prompts], data_split="10,0,0"))
    with pytest.raises(Exception, match="exceeds the model context of 64"):
        pool.run(step3_run, dict(base, data_path=[prompts], data_split="0,0,1", max_answer_seq_len=60))
    with pytest.raises(Exception, match=r"no usable step-3 prompts: \{'dropped': 12"):
        pool.run(
            step3_run, dict(base, data_path=[prompts], data_split="0,0,1", max_prompt_seq_len=2, prompt_policy="drop")
        )  # every 4-token prompt is over the budget
    with pytest.raises(Exception, match="has 12 usable prompt.*one iteration needs 16"):
        pool.run(
            step3_run,
            dict(
                base,
                data_path=[prompts],
                data_split="0,0,1",
                per_device_generation_batch_size=16,
                per_device_training_batch_size=4,
            ),
        )


def test_prompt_budget_drop_and_truncate_are_counted(tmp_path: Path) -> None:
    from hybridzero.rlhf.data.demo_task import build_tokenizer
    from hybridzero.rlhf.data.tokens import load_prompts
    from hybridzero.rlhf.settings import PPOSettings

    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1 2 ="}, {"prompt": "1 2 3 4 5 6 ="}, {"prompt": "7 ="}])
    tok = build_tokenizer()
    common = {"data_path": [path], "data_split": "0,0,1", "max_prompt_seq_len": 4, "max_answer_seq_len": 4}
    kept, counts = load_prompts(PPOSettings(**common, prompt_policy="drop"), tok, 64)
    assert sorted(kept) == ["1 2 =", "7 ="] and counts == {"dropped": 1, "truncated": 0, "empty": 0}
    kept, counts = load_prompts(PPOSettings(**common, prompt_policy="truncate"), tok, 64)
    assert sorted(kept) == ["1 2 =", "4 5 6 =", "7 ="]  # the last 4 tokens of the long prompt
    assert counts == {"dropped": 0, "truncated": 1, "empty": 0}
    with pytest.raises(ValueError, match="exceeds the model context of 6 positions"):
        load_prompts(PPOSettings(**common), tok, 6)


def test_tokenizer_without_pad_pads_with_eos_and_without_either_fails() -> None:
    from hybridzero.rlhf.data import pad_token_id
    from hybridzero.rlhf.data.demo_task import build_tokenizer

    tok = build_tokenizer()
    tok.pad_token = None
    assert pad_token_id(tok, pad_to_eos=True) == tok.eos_token_id
    tok.eos_token = None
    with pytest.raises(ValueError, match="tokenizer has no pad token"):
        pad_token_id(tok, pad_to_eos=True)


def test_add_eot_token_adds_one_special_token_that_ends_answers(world, tmp_path: Path) -> None:
    """DeepSpeed-Chat's ``--add_eot_token``: the eot string becomes one new special token (the tokenizer's eos, so
    every answer ends with it and step 3 stops at it), the embeddings grow to cover it (a multiple of 8, new rows
    alike on every rank), and steps 1 and 2 save directories that load with it."""
    import transformers

    from hybridzero.rlhf.data.tokens import sft_example
    from hybridzero.rlhf.models import load_value_model

    actor, _ = make_model_dirs(tmp_path / "models")
    before = transformers.AutoTokenizer.from_pretrained(actor)
    vocab = transformers.AutoConfig.from_pretrained(actor).vocab_size
    eot = "<|eot|>"
    common = {"per_device_train_batch_size": 4, "max_seq_len": 24, "progress": False, "max_steps": 2}
    common |= {"model_name_or_path": actor, "add_eot_token": True, "eot_token": eot, "print_every": 1000}
    pool = world(2)
    pool.run(sft_run, dict(common, output_dir=str(tmp_path / "sft")))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "sft")
    assert tok.eos_token == eot and eot not in before.get_vocab() and len(tok) == len(before) + 1
    grown = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    size = grown.get_input_embeddings().num_embeddings
    assert size == grown.config.vocab_size and size % 8 == 0 and size >= len(tok) and size >= vocab
    example = sft_example(tok, "Q: 12", " 21", 24)
    assert example.input_ids[-1] == tok.convert_tokens_to_ids(eot) == tok.eos_token_id
    pool.run(reward_run, dict(common, model_name_or_path=str(tmp_path / "sft"), output_dir=str(tmp_path / "rm")))
    rm = load_value_model(tmp_path / "rm")
    assert rm.transformer.get_input_embeddings().num_embeddings == size


def _weights(path: Path, value: bool) -> dict[str, torch.Tensor]:
    import transformers

    from hybridzero.rlhf.models import load_value_model

    model = load_value_model(path) if value else transformers.AutoModelForCausalLM.from_pretrained(path)
    return model.state_dict()


@pytest.mark.parametrize(
    ("run", "stage", "dtype", "extra"),
    [
        ("reward", 3, "fp16", {"gradient_checkpointing": True, "weight_decay": 0.1}),  # llama2/run_llama2_7b.sh
        ("sft", 2, "fp32", {"lora_dim": 4, "lora_module_name": "layers."}),
    ],
)
def test_steps12_offload_is_bitwise_the_run_without(
    world, tmp_path: Path, run: str, stage: int, dtype: str, extra: dict[str, object]
) -> None:
    """DeepSpeed-Chat's ``--offload`` at steps 1-2 (the llama2 reward scripts pass it): ZeRO-Offload of the
    optimizer (fp32 master, gradients, Adam state on the host; at stage 3 the parameter shards too) changes where
    the state lives, not one bit of the result: every metric and every saved weight equal the run without."""
    actor, _ = make_model_dirs(tmp_path / "models")
    pool = world(2)
    common = {"per_device_train_batch_size": 2, "max_seq_len": 24, "progress": False, "max_steps": 3}
    common |= {"model_name_or_path": actor, "zero_stage": stage, "dtype": dtype, "print_every": 1000, **extra}
    fn = reward_run if run == "reward" else sft_run
    results = {}
    for offload in (False, True):
        out = tmp_path / f"{run}_{offload}"
        metrics = pool.run(fn, dict(common, offload=offload, output_dir=str(out)))
        results[offload] = ({k: v for k, v in metrics[0].items() if k != "step_time_s"}, _weights(out, run == "reward"))
    (plain, plain_w), (off, off_w) = results[False], results[True]
    assert plain == off and plain["loss"] > 0.0
    assert plain_w.keys() == off_w.keys() and all(torch.equal(plain_w[k], off_w[k]) for k in plain_w)
