"""The second demo's task, "add a digit": data, the exact checker and the imperfect demonstrations.

A prompt is a 3-5 digit number (no leading zero), ``=``, one digit 1-9, ``=`` — read "3897 plus 5": for
``"3 8 9 7 = 5 ="`` the correct answer is ``"3 9 0 2"`` (then end of sequence). Words are the demo tokenizer's
(:func:`hybridzero.rlhf.data.demo_task.build_tokenizer`: digits, ``=`` and the special tokens), so the demo's tiny Llama
is used as is. About 45% of prompts need a carry out of the last digit (the addend plus the last digit reach 10),
and a carry runs on through every 9 before it (``9 9 7 = 5 =`` -> ``1 0 0 2``).

Invariants of the generated data:

* SFT demonstrations are imperfect in one systematic way: when the sum needs a carry, the demonstration drops it
  with probability :data:`DROP_CARRY` (only the last digit changes, to ``(last + addend) mod 10``); every other
  demonstration is correct. A policy that imitates them is right on every no-carry prompt and on
  ``1 - DROP_CARRY`` of the carry prompts, which leaves the RL step room that only the exact checker can close;
* prompt records carry the correct ``answer`` column (for reward functions that read dataset columns); their
  prompt strings are unique, and the held-out evaluation prompts are disjoint from the RL prompts and from every
  SFT prompt;
* everything is a pure function of the seeds (``random.Random``; no global random state, no downloads).

The checker (:func:`exact_score`) parses the answer from the prompt alone, so it needs no dataset column.
"""

from __future__ import annotations

import json
import random
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Literal

from hybridzero.rlhf.data.demo_task import DIGITS, EOS, EQUALS, SPECIAL_TOKENS

__all__ = [
    "ARITH_SEED",
    "ARITH_SIZES",
    "DROP_CARRY",
    "arith_data_dir",
    "correct_answer",
    "dropped_carry_answer",
    "exact_score",
    "format_score",
    "is_dropped_carry",
    "make_records",
    "needs_carry",
    "parse_prompt",
    "write_arith_data",
]

MIN_DIGITS, MAX_DIGITS = 3, 5
DROP_CARRY = 0.6
ARITH_SEED = 0
ARITH_SIZES: dict[str, int] = {"sft": 4000, "prompts": 1024, "eval": 256}
_SEED_OFFSETS: dict[str, int] = {"sft": 0, "prompts": 1, "eval": 2}
ArithKind = Literal["sft", "prompts"]


def parse_prompt(prompt: str) -> tuple[int, int]:
    """``(number, addend)`` of a prompt ``"d d d = a ="`` (special-token words ignored); ``ValueError`` otherwise."""
    words = [w for w in prompt.split() if w not in SPECIAL_TOKENS]
    if words.count(EQUALS) != 2 or words[-1] != EQUALS:
        raise ValueError(f"not an arithmetic demo prompt (digits, '=', one digit, '='): {prompt!r}")
    cut = words.index(EQUALS)
    number, addend = words[:cut], words[cut + 1 : -1]
    if not number or len(addend) != 1 or any(w not in DIGITS for w in number + addend):
        raise ValueError(f"not an arithmetic demo prompt (digits, '=', one digit, '='): {prompt!r}")
    return int("".join(number)), int(addend[0])


def _spaced(value: int) -> str:
    return " ".join(str(value))


def correct_answer(prompt: str) -> str:
    """The exact answer: the sum's digits separated by single spaces."""
    number, addend = parse_prompt(prompt)
    return _spaced(number + addend)


def needs_carry(prompt: str) -> bool:
    """True iff the last digit plus the addend reaches 10 (so dropping the carry gives a wrong answer)."""
    number, addend = parse_prompt(prompt)
    return number % 10 + addend >= 10


def dropped_carry_answer(prompt: str) -> str:
    """The demonstrations' systematic error: the last digit becomes ``(last + addend) mod 10``, nothing else moves."""
    number, addend = parse_prompt(prompt)
    return _spaced(number - number % 10 + (number % 10 + addend) % 10)


def _answer_words(completion: str) -> list[str]:
    """The completion's words before the first ``</s>``, special-token words dropped."""
    return [w for w in completion.split(EOS, 1)[0].split() if w not in SPECIAL_TOKENS]


def exact_score(prompt: str, completion: str) -> float:
    """1.0 iff the completion's words are exactly the sum's digits, else 0.0 (whitespace-insensitive; everything
    from the first ``</s>`` on is ignored). Raises ``ValueError`` for a prompt that is not an arithmetic prompt."""
    return 1.0 if _answer_words(completion) == correct_answer(prompt).split() else 0.0


def format_score(prompt: str, completion: str) -> float:
    """1.0 iff the completion is a plausible answer: only digit words, no leading zero, as many digits as the
    number or one more. Says nothing about correctness; always in ``{0.0, 1.0}``."""
    number, _ = parse_prompt(prompt)
    words = _answer_words(completion)
    width = len(str(number))
    ok = bool(words) and all(w in DIGITS for w in words) and words[0] != "0" and width <= len(words) <= width + 1
    return 1.0 if ok else 0.0


def is_dropped_carry(prompt: str, completion: str) -> bool:
    """True iff the completion is the dropped-carry answer of a prompt that needs a carry (the bad habit)."""
    return needs_carry(prompt) and _answer_words(completion) == dropped_carry_answer(prompt).split()


def _draw_prompt(rng: random.Random) -> str:
    width = rng.randint(MIN_DIGITS, MAX_DIGITS)
    number = rng.randrange(10 ** (width - 1), 10**width)
    return f"{_spaced(number)} {EQUALS} {rng.randint(1, 9)} {EQUALS}"


def make_records(n: int, seed: int, kind: ArithKind, exclude: Collection[str] = ()) -> list[dict[str, str]]:
    """``n`` records of ``kind``, a pure function of the arguments (``random.Random(seed)``); no prompt in
    ``exclude``.

    * ``"sft"``: ``{"prompt", "response"}``; the response is :func:`dropped_carry_answer` with probability
      :data:`DROP_CARRY` when the prompt needs a carry, else :func:`correct_answer` (prompts may repeat);
    * ``"prompts"``: ``{"prompt", "answer"}`` with unique prompts and the correct answer.
    """
    if kind not in ("sft", "prompts"):
        raise ValueError(f"kind must be 'sft' or 'prompts', got {kind!r}")
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    rng = random.Random(seed)
    blocked = set(exclude)  # a local copy: ``exclude`` is never mutated
    out: list[dict[str, str]] = []
    while len(out) < n:
        prompt = _draw_prompt(rng)
        if prompt in blocked:
            continue
        if kind == "sft":
            drop = needs_carry(prompt) and rng.random() < DROP_CARRY
            out.append({"prompt": prompt, "response": (dropped_carry_answer if drop else correct_answer)(prompt)})
        else:
            blocked.add(prompt)
            out.append({"prompt": prompt, "answer": correct_answer(prompt)})
    return out


def arith_data_dir() -> Path:
    """The directory of the shipped files (``sft.jsonl``, ``prompts.jsonl``, ``eval_prompts.jsonl``)."""
    return Path(__file__).resolve().parent.parent / "demo_data" / "arith"


def _write_jsonl(path: Path, records: Sequence[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records), encoding="utf-8")
    return path


def write_arith_data(
    out_dir: Path,
    seed: int = ARITH_SEED,
    n_sft: int = ARITH_SIZES["sft"],
    n_prompts: int = ARITH_SIZES["prompts"],
    n_eval: int = ARITH_SIZES["eval"],
) -> dict[str, Path]:
    """Write the three files into ``out_dir``; file ``k`` uses seed ``3 * seed + offset_k`` (sft 0, prompts 1,
    eval 2). The eval prompts exclude every SFT and RL prompt. Returns ``{"sft", "prompts", "eval"}`` -> path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sft = make_records(n_sft, 3 * seed + _SEED_OFFSETS["sft"], "sft")
    prompts = make_records(n_prompts, 3 * seed + _SEED_OFFSETS["prompts"], "prompts")
    seen = frozenset(r["prompt"] for r in sft + prompts)
    held = make_records(n_eval, 3 * seed + _SEED_OFFSETS["eval"], "prompts", exclude=seen)
    return {
        "sft": _write_jsonl(out_dir / "sft.jsonl", sft),
        "prompts": _write_jsonl(out_dir / "prompts.jsonl", prompts),
        "eval": _write_jsonl(out_dir / "eval_prompts.jsonl", held),
    }
