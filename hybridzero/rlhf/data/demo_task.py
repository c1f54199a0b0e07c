"""The embedded RLHF demo task, "reverse the digits": vocabulary, tokenizer, tiny model config, data and rule.

A prompt is 3-5 random digits separated by single spaces followed by ``=`` (``"3 8 1 5 ="``); the correct answer
is the digits in reverse order (``"5 1 8 3"``) and then end of sequence. Invariants of the generated data:

* no prompt is a palindrome, so the correct reversal and the "bad habit" copy always differ;
* SFT demonstrations are a mixture: each is the correct reversal with probability 1/2, else the copy;
* preference pairs always have ``chosen`` = the reversal and ``rejected`` != ``chosen`` (1/2 the copy, 1/4 one digit
  substituted, 1/4 one digit dropped or duplicated), so the rule scores every chosen 1 and every rejected 0;
* ``prompts`` records hold unique prompt strings; the evaluation prompts are disjoint from the PPO prompts.

The quality rule (:func:`rule_score`) lives only here: no model, reward model or training file ever sees it.
Everything is deterministic from the seeds (``random.Random``; no global random state, no downloads).
"""

from __future__ import annotations

import json
import random
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Literal

import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
DIGITS: tuple[str, ...] = tuple("0123456789")
EQUALS = "="
DEMO_VOCAB: dict[str, int] = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *DIGITS, EQUALS))}
MIN_DIGITS, MAX_DIGITS = 3, 5  # 3-6 learned markedly worse in a short CPU budget (bench/demo_task_probe.py)
MODEL_MAX_LENGTH = 64
RecordKind = Literal["sft", "pairs", "prompts"]
RECORD_KINDS: tuple[str, ...] = ("sft", "pairs", "prompts")
DEMO_SEED = 0
DEMO_SIZES: dict[str, int] = {"sft": 4000, "pairs": 1200, "prompts": 768, "eval": 256}
# write_demo_data derives one seed per file: 4 * seed + offset (so files of one seed never share a stream).
_SEED_OFFSETS: dict[str, int] = {"sft": 0, "pairs": 1, "prompts": 2, "eval": 3}


# ----------------------------------------------------------------------------------------------- tokenizer / model


def build_tokenizer(padding_side: Literal["left", "right"] = "right") -> transformers.PreTrainedTokenizerFast:
    """The demo's word-level tokenizer over :data:`DEMO_VOCAB`, built in code (nothing is downloaded).

    Words are split on whitespace only (``"38"`` is one unknown word); no special token is ever added
    automatically (no post-processor), so ``tok(text).input_ids`` are exactly the words' ids. With no decoder,
    ``decode`` joins tokens with single spaces: ``decode(encode("3 8 1 =")) == "3 8 1 ="``. The result
    round-trips through ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` offline.
    """
    core = Tokenizer(models.WordLevel(dict(DEMO_VOCAB), unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side=padding_side,
        clean_up_tokenization_spaces=False,
    )


def demo_model_config(tokenizer: transformers.PreTrainedTokenizerBase) -> transformers.LlamaConfig:
    """A tiny Llama for the demo: hidden 64, 2 blocks, 4 query heads of size 32 sharing 2 kv heads, untied
    embeddings (~119K parameters).

    The head size is set explicitly (not hidden / heads = 16): vLLM's CPU attention rejects head sizes 16 and 24
    (32 and 64 run), and the demo also runs with ``--rollout_engine vllm``. ``vocab_size`` is ``len(tokenizer)``
    and the pad/bos/eos ids come from the tokenizer; the context is :data:`MODEL_MAX_LENGTH` positions (a prompt is
    at most 6 tokens, an answer at most 5 plus eos).
    """
    return transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # the attention is 128 wide (4 x 32) over a 64-wide residual stream; q/o project 64 <-> 128
        max_position_embeddings=MODEL_MAX_LENGTH,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation="eager",  # type: ignore[call-arg]  # a PretrainedConfig kwarg transformers' stubs omit
    )


# ----------------------------------------------------------------------------------------------- records


def prompt_space() -> int:
    """How many distinct demo prompts exist: digit strings of every allowed length that are not palindromes."""
    return sum(10**k - 10 ** ((k + 1) // 2) for k in range(MIN_DIGITS, MAX_DIGITS + 1))


def _draw_digits(rng: random.Random) -> list[str]:
    """3-5 uniform random digits (length uniform too) that do not read the same backwards."""
    while True:
        digits = [rng.choice(DIGITS) for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS))]
        if digits != digits[::-1]:
            return digits


def _draw_prompt(rng: random.Random, exclude: Collection[str]) -> tuple[str, list[str]]:
    """A fresh prompt string (never in ``exclude``) and its digits."""
    while True:
        digits = _draw_digits(rng)
        prompt = " ".join(digits) + " " + EQUALS
        if prompt not in exclude:
            return prompt, digits


def _corrupt(rng: random.Random, reversed_digits: list[str]) -> list[str]:
    """A wrong answer: 1/2 the copy, 1/4 one digit substituted, 1/4 one digit dropped or duplicated."""
    roll = rng.random()
    if roll < 0.5:
        return reversed_digits[::-1]
    out = list(reversed_digits)
    pos = rng.randrange(len(out))
    if roll < 0.75:
        out[pos] = rng.choice([d for d in DIGITS if d != out[pos]])
    elif rng.random() < 0.5:
        del out[pos]
    else:
        out.insert(pos, out[pos])
    return out


def make_records(n: int, seed: int, kind: RecordKind, exclude: Collection[str] = ()) -> list[dict[str, str]]:
    """``n`` demo records of ``kind``, a pure function of ``(n, seed, kind, exclude)`` via ``random.Random(seed)``.

    * ``"sft"``: ``{"prompt", "response"}``; the response is the reversal with probability 1/2, else the copy;
    * ``"pairs"``: ``{"prompt", "chosen", "rejected"}``; chosen is the reversal, rejected != chosen;
    * ``"prompts"``: ``{"prompt"}`` with unique prompt strings (raises ``ValueError`` when ``n`` is more than
      half of the prompts not in ``exclude``, see :func:`prompt_space`, where unique draws would crawl).

    No prompt of any kind is in ``exclude``. Answers carry no eos: the data helpers append it.
    """
    if kind not in RECORD_KINDS:
        raise ValueError(f"kind must be one of {list(RECORD_KINDS)}, got {kind!r}")
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if kind == "prompts" and n > (prompt_space() - len(exclude)) // 2:
        raise ValueError(
            f"{n} unique prompts requested; at most half of the {prompt_space()} prompts not excluded are supported"
        )
    rng = random.Random(seed)
    blocked: set[str] = set(exclude)  # a local copy: ``exclude`` is never mutated
    records: list[dict[str, str]] = []
    while len(records) < n:
        prompt, digits = _draw_prompt(rng, blocked)
        answer = digits[::-1]
        if kind == "sft":
            response = answer if rng.random() < 0.5 else digits
            records.append({"prompt": prompt, "response": " ".join(response)})
        elif kind == "pairs":
            records.append({"prompt": prompt, "chosen": " ".join(answer), "rejected": " ".join(_corrupt(rng, answer))})
        else:
            blocked.add(prompt)
            records.append({"prompt": prompt})
    return records


# ----------------------------------------------------------------------------------------------- rule


def _prompt_digits(prompt: str) -> list[str]:
    """The digits of a demo prompt (the words before the first ``=``, special-token words ignored)."""
    words = [w for w in prompt.split() if w not in SPECIAL_TOKENS]
    if EQUALS in words:
        words = words[: words.index(EQUALS)]
    if not words or any(w not in DIGITS for w in words):
        raise ValueError(f"not a demo prompt (digits separated by spaces, then '='): {prompt!r}")
    return words


def _response_words(response: str) -> list[str]:
    """The response's words before the first ``</s>``, with special-token words (``<pad>``, ``<s>``...) dropped."""
    head = response.split(EOS, 1)[0]
    return [w for w in head.split() if w not in SPECIAL_TOKENS]


def rule_score(prompt: str, response: str) -> float:
    """The hidden rule: 1.0 iff the response's words are exactly the prompt's digits reversed, else 0.0.

    Words are whitespace-split (any amount of whitespace), everything from the first ``</s>`` on is ignored, and
    special-token words are dropped; any other word (``=``, ``38``, ``x``) is wrong. Raises ``ValueError`` for a
    prompt that is not a demo prompt.
    """
    return 1.0 if _response_words(response) == _prompt_digits(prompt)[::-1] else 0.0


def rule_partial(prompt: str, response: str) -> float:
    """Fraction of positions where the response's word equals the reversed prompt's digit.

    Positions are compared from the start; the count is divided by ``max(len(expected), len(got))`` so a missing
    or extra word counts against. Parsing is as in :func:`rule_score`; always in ``[0, 1]``.
    """
    expected, got = _prompt_digits(prompt)[::-1], _response_words(response)
    hits = sum(e == g for e, g in zip(expected, got))
    return hits / max(len(expected), len(got))


def rule_is_copy(prompt: str, response: str) -> bool:
    """True iff the response is exactly the prompt's digits in the given order (the demonstrations' bad habit)."""
    return _response_words(response) == _prompt_digits(prompt)


def rule_scores(prompts: Sequence[str], responses: Sequence[str]) -> dict[str, float]:
    """Means over paired prompts/responses: ``exact`` (:func:`rule_score`), ``partial`` (:func:`rule_partial`)
    and ``copy`` (the fraction that are the bad-habit copy). Raises ``ValueError`` on empty or unequal inputs."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        raise ValueError("rule_scores needs at least one prompt/response pair")
    n = len(prompts)
    pairs = list(zip(prompts, responses))
    return {
        "exact": sum(rule_score(p, r) for p, r in pairs) / n,
        "partial": sum(rule_partial(p, r) for p, r in pairs) / n,
        "copy": sum(rule_is_copy(p, r) for p, r in pairs) / n,
    }


# ----------------------------------------------------------------------------------------------- files


def demo_data_dir() -> Path:
    """The directory of the shipped demo JSONL files (``sft``, ``pairs``, ``prompts``, ``eval_prompts``)."""
    return Path(__file__).resolve().parent.parent / "demo_data"


def _write_jsonl(path: Path, records: Sequence[dict[str, str]]) -> Path:
    """Write one compact JSON object per line (LF endings, UTF-8, trailing newline)."""
    text = "".join(json.dumps(record, separators=(",", ":")) + "\n" for record in records)
    path.write_text(text, encoding="utf-8", newline="\n")
    return path


def write_demo_data(
    out_dir: Path,
    seed: int = DEMO_SEED,
    n_sft: int = DEMO_SIZES["sft"],
    n_pairs: int = DEMO_SIZES["pairs"],
    n_prompts: int = DEMO_SIZES["prompts"],
    n_eval: int = DEMO_SIZES["eval"],
) -> dict[str, Path]:
    """Write ``sft.jsonl``, ``pairs.jsonl``, ``prompts.jsonl`` and ``eval_prompts.jsonl`` into ``out_dir``.

    File ``k`` holds ``make_records(n_k, 4 * seed + offset_k, kind_k)`` with offsets sft 0, pairs 1, prompts 2,
    eval 3; the eval prompts are drawn with ``exclude`` = the PPO prompts, so the two sets are disjoint.
    Returns ``{"sft", "pairs", "prompts", "eval"}`` -> path.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = make_records(n_prompts, 4 * seed + _SEED_OFFSETS["prompts"], "prompts")
    ppo_strings = frozenset(record["prompt"] for record in prompts)
    return {
        "sft": _write_jsonl(out_dir / "sft.jsonl", make_records(n_sft, 4 * seed + _SEED_OFFSETS["sft"], "sft")),
        "pairs": _write_jsonl(
            out_dir / "pairs.jsonl", make_records(n_pairs, 4 * seed + _SEED_OFFSETS["pairs"], "pairs")
        ),
        "prompts": _write_jsonl(out_dir / "prompts.jsonl", prompts),
        "eval": _write_jsonl(
            out_dir / "eval_prompts.jsonl",
            make_records(n_eval, 4 * seed + _SEED_OFFSETS["eval"], "prompts", exclude=ppo_strings),
        ),
    }
