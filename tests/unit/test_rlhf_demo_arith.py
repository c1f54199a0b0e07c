"""Tests of the arithmetic demo's task (hybridzero.rlhf.demo.arith) and its reward functions (demo.rewards)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridzero.rlhf.data.demo_task import build_tokenizer
from hybridzero.rlhf.demo.arith import (
    ARITH_SEED,
    ARITH_SIZES,
    DROP_CARRY,
    arith_data_dir,
    correct_answer,
    dropped_carry_answer,
    exact_score,
    format_score,
    is_dropped_carry,
    make_records,
    needs_carry,
    parse_prompt,
    write_arith_data,
)
from hybridzero.rlhf.demo.rewards import answer_format, exact_answer


def rows(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_parse_and_answers_by_hand() -> None:
    assert parse_prompt("3 8 9 7 = 5 =") == (3897, 5)
    assert parse_prompt("<s> 1 0 0 = 9 = <pad>") == (100, 9)
    assert correct_answer("3 8 9 7 = 5 =") == "3 9 0 2"
    assert dropped_carry_answer("3 8 9 7 = 5 =") == "3 8 9 2"
    assert correct_answer("9 9 7 = 5 =") == "1 0 0 2"  # the carry runs through the 9s and adds a digit
    assert correct_answer("1 2 3 = 4 =") == dropped_carry_answer("1 2 3 = 4 =") == "1 2 7"
    assert needs_carry("3 8 9 7 = 5 =") and not needs_carry("1 2 3 = 4 =") and needs_carry("1 2 5 = 5 =")


@pytest.mark.parametrize("bad", ["3 8 9 7 =", "3 8 = 5 5 =", "3 x = 5 =", "= 5 =", "3 8 = 5", "3 = 4 = 5 ="])
def test_parse_rejects_non_prompts(bad: str) -> None:
    with pytest.raises(ValueError, match="not an arithmetic demo prompt"):
        parse_prompt(bad)


def test_checkers() -> None:
    p = "3 8 9 7 = 5 ="
    assert exact_score(p, "3 9 0 2") == 1.0 and exact_score(p, " 3  9 0\t2 </s> 7 7") == 1.0
    assert exact_score(p, "3 9 0 2 <pad>") == 1.0 and exact_score(p, "3 8 9 2") == 0.0
    assert exact_score(p, "3 9 0") == 0.0 and exact_score(p, "3 9 0 2 2") == 0.0 and exact_score(p, "") == 0.0
    assert is_dropped_carry(p, "3 8 9 2") and not is_dropped_carry(p, "3 9 0 2")
    assert not is_dropped_carry("1 2 3 = 4 =", "1 2 7")  # no carry needed: the habit is invisible
    assert format_score(p, "3 8 9 2") == 1.0 and format_score(p, "1 3 8 9 2") == 1.0
    assert format_score(p, "0 8 9 2") == 0.0 and format_score(p, "3 8 =") == 0.0 and format_score(p, "3 8") == 0.0
    assert format_score(p, "") == 0.0


def test_reward_functions_trl_signature() -> None:
    prompts = ["3 8 9 7 = 5 =", "1 2 3 = 4 =", "9 9 7 = 5 ="]
    completions = ["3 9 0 2", "1 2 8", "9 9 2"]
    cols = {"answer": ["3 9 0 2", "1 2 7", "1 0 0 2"], "completion_ids": [[1], [2], [3]], "trainer_state": None}
    assert exact_answer(prompts=prompts, completions=completions, **cols) == [1.0, 0.0, 0.0]
    assert answer_format(prompts=prompts, completions=completions, **cols) == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="2 prompts but 3 completions"):
        exact_answer(prompts=prompts[:2], completions=completions)
    with pytest.raises(TypeError, match="strings"):
        exact_answer(prompts=prompts[:1], completions=[[{"role": "assistant", "content": "1"}]])  # type: ignore[list-item]


def test_records_invariants() -> None:
    sft = make_records(3000, 5, "sft")
    assert all(set(r) == {"prompt", "response"} for r in sft)
    carry = [r for r in sft if needs_carry(r["prompt"])]
    assert 0.35 < len(carry) / len(sft) < 0.55  # P(last + addend >= 10) = 0.45
    dropped = sum(r["response"] == dropped_carry_answer(r["prompt"]) for r in carry) / len(carry)
    assert abs(dropped - DROP_CARRY) < 0.05
    assert all(exact_score(r["prompt"], r["response"]) for r in sft if not needs_carry(r["prompt"]))
    assert all(exact_score(r["prompt"], r["response"]) or is_dropped_carry(r["prompt"], r["response"]) for r in sft)
    prompts = make_records(500, 6, "prompts", exclude={r["prompt"] for r in sft})
    assert len({r["prompt"] for r in prompts}) == 500
    assert all(r["answer"] == correct_answer(r["prompt"]) for r in prompts)
    assert not {r["prompt"] for r in prompts} & {r["prompt"] for r in sft}
    assert make_records(50, 5, "sft") == sft[:50]  # a pure function of the seed
    with pytest.raises(ValueError, match="kind must be"):
        make_records(1, 0, "pairs")  # type: ignore[arg-type]


def test_prompts_fit_the_demo_tokenizer() -> None:
    tok = build_tokenizer()
    for r in make_records(200, 9, "sft"):
        ids = tok(r["prompt"] + " " + r["response"]).input_ids
        assert tok.unk_token_id not in ids and len(tok(r["prompt"]).input_ids) <= 8


def test_shipped_files_equal_regeneration(tmp_path: Path) -> None:
    fresh = write_arith_data(tmp_path, ARITH_SEED)
    for name, path in fresh.items():
        assert path.read_bytes() == (arith_data_dir() / path.name).read_bytes(), name
    sizes = {k: len(rows(p)) for k, p in fresh.items()}
    assert sizes == ARITH_SIZES
    held = {r["prompt"] for r in rows(fresh["eval"])}
    seen = {r["prompt"] for r in rows(fresh["sft"]) + rows(fresh["prompts"])}
    assert len(held) == ARITH_SIZES["eval"] and not held & seen
