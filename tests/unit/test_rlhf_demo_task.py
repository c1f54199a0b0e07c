"""Tests of hybridzero.rlhf.data.demo_task: tokenizer, tiny model config, records, the hidden rule and the shipped
files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from hybridzero.rlhf.data import (
    IGNORE_INDEX,
    PAIRWISE_COLUMNS,
    SFT_COLUMNS,
    load_records,
    pairwise_example,
    prompt_batch,
    sft_example,
)
from hybridzero.rlhf.data.demo_task import (
    DEMO_SEED,
    DEMO_SIZES,
    DEMO_VOCAB,
    build_tokenizer,
    demo_data_dir,
    demo_model_config,
    make_records,
    prompt_space,
    rule_is_copy,
    rule_partial,
    rule_score,
    rule_scores,
    write_demo_data,
)

FILES: dict[str, str] = {
    "sft": "sft.jsonl",
    "pairs": "pairs.jsonl",
    "prompts": "prompts.jsonl",
    "eval": "eval_prompts.jsonl",
}


def shipped(name: str) -> list[dict[str, str]]:
    """The rows of one shipped demo file, parsed as plain JSON lines."""
    text = (demo_data_dir() / FILES[name]).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


# ------------------------------------------------------------------ tokenizer and model config


def test_prompt_space_counts_non_palindromes() -> None:
    assert prompt_space() == 900 + 9900 + 99000  # 3, 4, 5 digits less their 10, 100, 1000 palindromes


def test_vocab_layout() -> None:
    assert [DEMO_VOCAB[t] for t in ("<pad>", "<s>", "</s>", "<unk>")] == [0, 1, 2, 3]
    assert [DEMO_VOCAB[str(d)] for d in range(10)] == list(range(4, 14))
    assert DEMO_VOCAB["="] == 14 and len(DEMO_VOCAB) == 15


def test_tokenizer_encode_decode() -> None:
    tok = build_tokenizer()
    ids = tok("3 8 1 =").input_ids
    assert ids == [7, 12, 5, 14]  # no bos / eos added
    assert tok.decode(ids, skip_special_tokens=True) == "3 8 1 ="
    assert tok.decode([*ids, 2, 0], skip_special_tokens=False) == "3 8 1 = </s> <pad>"
    assert tok.decode([*ids, 2, 0], skip_special_tokens=True) == "3 8 1 ="
    assert tok.encode("  3\t8 </s>", add_special_tokens=False) == [7, 12, 2]
    assert tok.encode("38 x", add_special_tokens=False) == [3, 3]  # unknown words
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.model_max_length == 64 and len(tok) == 15
    assert build_tokenizer("left").padding_side == "left"


def test_tokenizer_round_trip_offline(tmp_path: Path) -> None:
    tok = build_tokenizer(padding_side="left")
    tok.save_pretrained(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "9 0 4 = 4 0 9"
    assert loaded(text).input_ids == tok(text).input_ids
    assert loaded.decode(loaded(text).input_ids) == text
    assert (loaded.pad_token, loaded.bos_token, loaded.eos_token, loaded.unk_token) == ("<pad>", "<s>", "</s>", "<unk>")
    assert loaded.padding_side == "left" and loaded.model_max_length == 64
    assert loaded.get_vocab() == DEMO_VOCAB


def test_model_config_and_forward() -> None:
    tok = build_tokenizer()
    config = demo_model_config(tok)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (15, 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 176)
    assert config.head_dim == 32  # vLLM's CPU attention takes head sizes 32, 64, ... (not hidden / heads = 16)
    assert config.max_position_embeddings == 64 and not config.tie_word_embeddings
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    example = sft_example(tok, "3 8 1 =", "1 8 3", max_len=16)
    out = model(input_ids=torch.tensor([example.input_ids]), labels=torch.tensor([example.labels]))
    assert out.logits.shape == (1, 8, 15) and torch.isfinite(out.loss)
    assert sum(p.numel() for p in model.parameters()) == 118_976


# ------------------------------------------------------------------ the rule


@pytest.mark.parametrize(
    ("response", "exact", "partial", "copy"),
    [
        ("5 1 8 3", 1.0, 1.0, False),  # correct
        ("3 8 1 5", 0.0, 0.0, True),  # the bad-habit copy
        ("5 1 9 3", 0.0, 0.75, False),  # one digit substituted
        ("5 1 3", 0.0, 0.5, False),  # one digit dropped (positions shift)
        ("5 1 8 8 3", 0.0, 0.6, False),  # one digit duplicated
        ("5 1 8 3 </s>", 1.0, 1.0, False),  # trailing eos
        ("5 1 8 3</s> 7 7 <pad>", 1.0, 1.0, False),  # anything after the first eos is ignored
        ("  5\t1  8 3\n", 1.0, 1.0, False),  # extra whitespace
        ("<s> 5 1 8 3 <pad>", 1.0, 1.0, False),  # special-token words are dropped
        ("", 0.0, 0.0, False),  # empty
        ("</s> 5 1 8 3", 0.0, 0.0, False),  # nothing before the eos
        ("5 1 8 3 =", 0.0, 0.8, False),  # an extra non-digit word
        ("5183", 0.0, 0.0, False),  # not space separated
    ],
)
def test_rule_on_hand_examples(response: str, exact: float, partial: float, copy: bool) -> None:
    prompt = "3 8 1 5 ="
    assert rule_score(prompt, response) == exact
    assert rule_partial(prompt, response) == pytest.approx(partial)
    assert rule_is_copy(prompt, response) is copy


def test_rule_rejects_non_demo_prompts_and_aggregates() -> None:
    for bad in ("", "=", "3 x 5 =", "38 ="):
        with pytest.raises(ValueError, match="not a demo prompt"):
            rule_score(bad, "1")
    scores = rule_scores(["1 2 3 =", "4 5 6 =", "7 8 9 ="], ["3 2 1", "4 5 6", "9 8"])
    assert scores == pytest.approx({"exact": 1 / 3, "partial": (1 + 1 / 3 + 2 / 3) / 3, "copy": 1 / 3})
    with pytest.raises(ValueError):
        rule_scores(["1 2 ="], [])
    with pytest.raises(ValueError):
        rule_scores([], [])


# ------------------------------------------------------------------ records and shipped files


def test_make_records_is_deterministic_and_well_formed() -> None:
    assert make_records(50, 7, "pairs") == make_records(50, 7, "pairs")
    assert make_records(50, 7, "sft") != make_records(50, 8, "sft")
    for row in make_records(300, 1, "sft"):
        digits = row["prompt"].split()
        assert digits[-1] == "=" and 3 <= len(digits) - 1 <= 5 and digits[:-1] != digits[-2::-1]
        assert rule_score(row["prompt"], row["response"]) == 1.0 or rule_is_copy(row["prompt"], row["response"])
    prompts = [r["prompt"] for r in make_records(400, 3, "prompts")]
    assert len(set(prompts)) == 400
    excluded = set(prompts[:200])
    assert not excluded & {r["prompt"] for r in make_records(400, 3, "sft", exclude=excluded)}
    with pytest.raises(ValueError, match="kind"):
        make_records(1, 0, "bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unique prompts"):
        make_records(prompt_space() // 2 + 1, 0, "prompts")


def test_shipped_files_equal_regeneration(tmp_path: Path) -> None:
    paths = write_demo_data(
        tmp_path,
        seed=DEMO_SEED,
        n_sft=DEMO_SIZES["sft"],
        n_pairs=DEMO_SIZES["pairs"],
        n_prompts=DEMO_SIZES["prompts"],
        n_eval=DEMO_SIZES["eval"],
    )
    assert set(paths) == set(FILES)
    for name, path in paths.items():
        assert path.name == FILES[name]
        assert path.read_bytes() == (demo_data_dir() / FILES[name]).read_bytes(), name
    assert sum(p.stat().st_size for p in demo_data_dir().iterdir()) < 300_000


def test_shipped_data_quality_invariants() -> None:
    sft, pairs, prompts, evals = (shipped(name) for name in ("sft", "pairs", "prompts", "eval"))
    assert [len(sft), len(pairs), len(prompts), len(evals)] == [
        DEMO_SIZES[k] for k in ("sft", "pairs", "prompts", "eval")
    ]
    correct = sum(rule_score(r["prompt"], r["response"]) for r in sft) / len(sft)
    assert 0.45 <= correct <= 0.55
    assert all(rule_score(r["prompt"], r["response"]) or rule_is_copy(r["prompt"], r["response"]) for r in sft)
    assert all(r["chosen"] != r["rejected"] for r in pairs)
    assert all(rule_score(r["prompt"], r["chosen"]) == 1.0 for r in pairs)
    assert all(rule_score(r["prompt"], r["rejected"]) == 0.0 for r in pairs)
    copies = sum(rule_is_copy(r["prompt"], r["rejected"]) for r in pairs) / len(pairs)
    assert 0.4 <= copies <= 0.6
    ppo, held_out = {r["prompt"] for r in prompts}, {r["prompt"] for r in evals}
    assert len(ppo) == len(prompts) and len(held_out) == len(evals) and not ppo & held_out


def test_shipped_files_work_with_the_data_helpers() -> None:
    tok = build_tokenizer()
    directory = demo_data_dir()
    sft = load_records(directory / "sft.jsonl")  # schema inferred: prompt / response
    assert sft == load_records(directory / "sft.jsonl", columns=SFT_COLUMNS)
    pairs = load_records(directory / "pairs.jsonl", columns=PAIRWISE_COLUMNS)
    prompts = load_records(directory / "prompts.jsonl", columns=("prompt",))
    evals = load_records(directory / "eval_prompts.jsonl", columns=("prompt",))
    assert len(evals) == DEMO_SIZES["eval"]
    eos = tok.eos_token_id
    for row in sft[:20]:
        example = sft_example(tok, row["prompt"], row["response"], max_len=16)
        n_prompt = len(row["prompt"].split())
        assert example.n_truncated == 0
        assert example.labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
        assert example.labels[n_prompt:] == example.input_ids[n_prompt:] and example.input_ids[-1] == eos
        assert tok.decode(example.input_ids, skip_special_tokens=True) == f"{row['prompt']} {row['response']}"
    for row in pairs[:20]:
        chosen, rejected = pairwise_example(tok, row["prompt"], row["chosen"], row["rejected"], max_len=16)
        assert chosen[-1] == eos and rejected[-1] == eos and chosen != rejected
        assert tok.unk_token_id not in chosen + rejected
    batch = prompt_batch(build_tokenizer("left"), [r["prompt"] for r in prompts[:8]], max_prompt_len=8)
    assert batch.counts == {"truncated": 0, "dropped": 0} and batch.input_ids.shape[0] == 8
    for ids, mask, row in zip(batch.input_ids, batch.attention_mask, prompts[:8]):
        assert tok.decode(ids[mask.bool()].tolist()) == row["prompt"]
        assert ids[-1].item() == DEMO_VOCAB["="]
