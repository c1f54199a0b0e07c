"""RLHF data: loading prompt / preference records, DeepSpeed-Chat phase splits, and tokenization helpers.

Schemas (every value a string):

* pairwise ``prompt`` / ``chosen`` / ``rejected`` -- reward model (phase 2), SFT on ``chosen`` (phase 1);
* SFT ``prompt`` / ``response`` -- SFT (phase 1) and PPO prompts (phase 3).

Sources: a ``.json`` file holding a list of objects, a ``.jsonl`` file (one object a line), or a local
Hugging Face ``datasets`` directory (written by ``save_to_disk``; needs the optional ``datasets`` package).

Phase split (DeepSpeed-Chat's ``--data_split 2,4,4``): one seeded permutation of the records is cut into three
contiguous, disjoint portions proportional to the weights, so the three training phases never see the same record.

Token layouts: SFT and pairwise sequences are ``prompt + answer + eos`` (no other special tokens, unpadded);
generation prompts are left-padded to a common width.
"""
from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridzero.rlhf.data_sources import (
    read_hf_directory,
    read_hub_dataset,
    read_json_file,
    read_jsonl_file,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX: int = -100
PAIRWISE_COLUMNS: tuple[str, ...] = ("prompt", "chosen", "rejected")
SFT_COLUMNS: tuple[str, ...] = ("prompt", "response")
PROMPT_POLICIES: tuple[str, ...] = ("truncate", "drop")


# ----------------------------------------------------------------------------------------------- loading


def _schema_for(columns: set[str]) -> tuple[str, ...]:
    """Guess the schema of a record: pairwise when it has a ``chosen`` or ``rejected`` column, else SFT."""
    return PAIRWISE_COLUMNS if columns & {"chosen", "rejected"} else SFT_COLUMNS


def _validate_rows(rows: list[Any], source: str, columns: tuple[str, ...] | None) -> list[dict[str, str]]:
    """Check every row is an object with string values in the needed columns; keep only those columns."""
    out: list[dict[str, str]] = []
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{source}: record {index} is {type(row).__name__}, expected an object")  # noqa: TRY004
        needed = columns if columns is not None else _schema_for(set(row))
        missing = [name for name in needed if name not in row]
        if missing:
            raise ValueError(
                f"{source}: record {index} is missing column(s) {missing}; needed {list(needed)}, "
                f"it has {sorted(row)}"
            )
        bad = [name for name in needed if not isinstance(row[name], str)]
        if bad:
            raise ValueError(f"{source}: record {index} column(s) {bad} are not strings")
        out.append({name: row[name] for name in needed})
    return out


def load_records(
    path: str | Path, columns: Sequence[str] | None = None, split: str = "train"
) -> list[dict[str, str]]:
    """Load and validate records from a ``.json`` / ``.jsonl`` file, a Hugging Face dataset directory, or a Hub
    dataset name (``Dahoas/rm-static``: anything that is not an existing path, a ``.json``/``.jsonl`` name, an
    absolute or a ``./`` path; needs ``datasets`` and network access or its cache).

    ``columns`` names the needed columns (e.g. :data:`PAIRWISE_COLUMNS`); ``None`` infers the schema per record
    (pairwise when ``chosen``/``rejected`` appear, else ``prompt``/``response``). Extra columns are dropped.
    ``split`` picks the split of a ``DatasetDict`` directory or Hub dataset. Raises ``FileNotFoundError`` for a
    missing path or a name the Hub cannot give (naming why),
    ``ImportError`` for a directory without the ``datasets`` package, and ``ValueError`` for an unknown file
    type, malformed JSON, an empty file/split, or records missing a needed column (naming the file, the missing
    columns and the columns present).
    """
    source = Path(path)
    if not source.exists():
        if source.suffix in (".json", ".jsonl") or source.is_absolute() or str(path).startswith("."):
            raise FileNotFoundError(f"no dataset at {source}")
        rows, label = read_hub_dataset(str(path), split), f"{path} (Hub, split {split!r})"
    elif source.is_dir():
        rows = read_hf_directory(source, split)
        label = f"{source} (split {split!r})"
    elif source.suffix == ".jsonl":
        rows, label = read_jsonl_file(source), str(source)
    elif source.suffix == ".json":
        rows, label = read_json_file(source), str(source)
    else:
        raise ValueError(f"{source}: unsupported file type {source.suffix!r}; use .json, .jsonl or a directory")
    if not rows:
        raise ValueError(f"{label}: dataset is empty (no records)")
    return _validate_rows(rows, label, tuple(columns) if columns is not None else None)


# ----------------------------------------------------------------------------------------------- splits


def _parse_split(split: str) -> list[Fraction]:
    """Parse ``"2,4,4"`` into three non-negative weights with a positive sum."""
    try:
        weights = [Fraction(part.strip()) for part in split.split(",")]
    except (ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"data split {split!r}: expected three comma-separated numbers") from exc
    if len(weights) != 3 or any(w < 0 for w in weights) or sum(weights) == 0:
        raise ValueError(
            f"data split {split!r}: expected three non-negative comma-separated weights with a positive sum"
        )
    return weights


def _phase_bounds(weights: list[Fraction], size: int) -> list[int]:
    """Cumulative cut points ``[0, b1, b2, size]``: each rounds the exact cumulative share half up."""
    total = sum(weights)
    bounds, running = [0], Fraction(0)
    for weight in weights:
        running += weight
        bounds.append(int(running * size / total + Fraction(1, 2)))
    return bounds


def _permutation(size: int, seed: int) -> list[int]:
    """A deterministic permutation of ``range(size)`` (independent of global random state)."""
    order = list(range(size))
    random.Random(seed).shuffle(order)
    return order


def split_for_phase(records: Sequence[Any], split: str = "2,4,4", phase: int = 1, seed: int = 1234) -> list[Any]:
    """Return the records of training ``phase`` (1 SFT, 2 reward model, 3 RL) under DeepSpeed-Chat's split.

    The records are shuffled with ``seed`` and the permutation is cut into three contiguous portions whose sizes
    are proportional to the ``split`` weights; cut points are rounded cumulatively, so every record belongs to
    exactly one phase and the same ``seed`` gives disjoint phases. Raises ``ValueError`` when the split is
    malformed, ``phase`` is not 1-3, or the phase's share is empty (naming the split string and the phase).
    """
    if phase not in (1, 2, 3):
        raise ValueError(f"phase must be 1, 2 or 3, got {phase!r}")
    weights = _parse_split(split)
    bounds = _phase_bounds(weights, len(records))
    start, stop = bounds[phase - 1], bounds[phase]
    if stop <= start:
        raise ValueError(
            f"data split {split!r} gives phase {phase} no records (of {len(records)}); "
            f"raise its weight or provide more data"
        )
    order = _permutation(len(records), seed)
    return [records[i] for i in order[start:stop]]


def train_eval_split(
    records: Sequence[Any], eval_fraction: float, seed: int = 1234
) -> tuple[list[Any], list[Any]]:
    """Shuffle with ``seed`` and hold out ``round(eval_fraction * n)`` (at least one) records for evaluation.

    Returns ``(train, eval)``, disjoint and together covering ``records``. Raises ``ValueError`` when
    ``eval_fraction`` is not in ``(0, 1)`` or either side would be empty.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    size = len(records)
    n_eval = max(1, int(Fraction(eval_fraction) * size + Fraction(1, 2)))
    if n_eval >= size:
        raise ValueError(
            f"eval_fraction {eval_fraction} of {size} record(s) leaves no training records; need more data"
        )
    order = _permutation(size, seed)
    return [records[i] for i in order[n_eval:]], [records[i] for i in order[:n_eval]]


# ----------------------------------------------------------------------------------------------- tokens


def pad_token_id(tok: PreTrainedTokenizerBase, pad_to_eos: bool = False) -> int:
    """The tokenizer's pad id; with ``pad_to_eos`` a missing pad token falls back to the eos token."""
    if tok.pad_token_id is not None:
        return int(tok.pad_token_id)
    if pad_to_eos and tok.eos_token_id is not None:
        return int(tok.eos_token_id)
    raise ValueError(
        "tokenizer has no pad token: set tokenizer.pad_token (e.g. tokenizer.pad_token = tokenizer.eos_token) "
        "or pass pad_to_eos=True to pad with the eos token"
    )


def check_budget(model_context: int, max_prompt_len: int, max_answer_len: int) -> None:
    """Raise ``ValueError`` unless ``max_prompt_len + max_answer_len`` fits the model context (``n_positions``)."""
    for name, value in (("model_context", model_context), ("max_prompt_len", max_prompt_len),
                        ("max_answer_len", max_answer_len)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if max_prompt_len + max_answer_len > model_context:
        raise ValueError(
            f"max_prompt_len {max_prompt_len} + max_answer_len {max_answer_len} = "
            f"{max_prompt_len + max_answer_len} exceeds the model context of {model_context} positions"
        )


def _encode(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens."""
    return [int(i) for i in tok.encode(text, add_special_tokens=False)]


def _answer_ids(tok: PreTrainedTokenizerBase, answer: str) -> list[int]:
    """Token ids of ``answer`` followed by eos (when the tokenizer has one); never empty."""
    ids = _encode(tok, answer)
    if tok.eos_token_id is not None:
        ids.append(int(tok.eos_token_id))
    if not ids:
        raise ValueError("answer tokenizes to no tokens and the tokenizer has no eos token")
    return ids


def _join(prompt_ids: list[int], answer_ids: list[int], max_len: int) -> tuple[list[int], int, int]:
    """Concatenate within ``max_len``; return ``(ids, n_prompt_kept, n_cut)``.

    The answer's tail is cut first; a prompt that alone fills the budget loses its start instead, so at least
    one answer token always remains.
    """
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2, got {max_len}")
    n_prompt = min(len(prompt_ids), max_len - 1)
    n_answer = min(len(answer_ids), max_len - n_prompt)
    kept_prompt = prompt_ids[len(prompt_ids) - n_prompt:]
    n_cut = len(prompt_ids) + len(answer_ids) - n_prompt - n_answer
    return kept_prompt + answer_ids[:n_answer], n_prompt, n_cut


@dataclass(frozen=True)
class SFTExample:
    """One SFT sequence; unpacks as ``input_ids, labels``. ``n_truncated`` counts the tokens cut off."""

    input_ids: list[int]
    labels: list[int]
    n_truncated: int

    def __iter__(self) -> Iterator[list[int]]:
        """Yield ``input_ids`` then ``labels``."""
        return iter((self.input_ids, self.labels))


@dataclass(frozen=True)
class PairwiseExample:
    """One preference pair; unpacks as ``chosen_ids, rejected_ids``. ``n_truncated`` sums tokens cut off."""

    chosen_ids: list[int]
    rejected_ids: list[int]
    n_truncated: int

    def __iter__(self) -> Iterator[list[int]]:
        """Yield ``chosen_ids`` then ``rejected_ids``."""
        return iter((self.chosen_ids, self.rejected_ids))


@dataclass(frozen=True)
class PromptBatch:
    """Left-padded generation prompts; unpacks as ``input_ids, attention_mask``.

    ``kept`` lists the indices (into the given prompts) of the rows, in order; ``counts`` is
    ``{"truncated": n, "dropped": m}``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    counts: dict[str, int]
    kept: list[int]

    def __iter__(self) -> Iterator[torch.Tensor]:
        """Yield ``input_ids`` then ``attention_mask``."""
        return iter((self.input_ids, self.attention_mask))


def sft_example(tok: PreTrainedTokenizerBase, prompt: str, response: str, max_len: int) -> SFTExample:
    """Tokenize ``prompt + response + eos`` within ``max_len``; labels are -100 on prompt tokens.

    The loss is thus masked to the response (and its eos). Truncation cuts the response's tail first, then
    the prompt's start; ``n_truncated`` reports how many tokens were cut.
    """
    ids, n_prompt, n_cut = _join(_encode(tok, prompt), _answer_ids(tok, response), max_len)
    labels = [IGNORE_INDEX] * n_prompt + ids[n_prompt:]
    return SFTExample(input_ids=ids, labels=labels, n_truncated=n_cut)


def pairwise_example(
    tok: PreTrainedTokenizerBase, prompt: str, chosen: str, rejected: str, max_len: int
) -> PairwiseExample:
    """Tokenize ``prompt + chosen + eos`` and ``prompt + rejected + eos``, each within ``max_len``."""
    prompt_ids = _encode(tok, prompt)
    chosen_ids, _, cut_chosen = _join(prompt_ids, _answer_ids(tok, chosen), max_len)
    rejected_ids, _, cut_rejected = _join(prompt_ids, _answer_ids(tok, rejected), max_len)
    return PairwiseExample(chosen_ids=chosen_ids, rejected_ids=rejected_ids, n_truncated=cut_chosen + cut_rejected)


def pad_sequences(sequences: Sequence[Sequence[int]], pad_value: int, left: bool = False) -> torch.Tensor:
    """Stack integer sequences into a ``[B, max_len]`` long tensor, padding on the right (or left)."""
    if not sequences:
        raise ValueError("pad_sequences needs at least one sequence")
    width = max(len(seq) for seq in sequences)
    out = torch.full((len(sequences), width), pad_value, dtype=torch.long)
    for row, seq in enumerate(sequences):
        start = width - len(seq) if left else 0
        out[row, start:start + len(seq)] = torch.tensor(list(seq), dtype=torch.long)
    return out


def prompt_batch(
    tok: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    max_prompt_len: int,
    policy: str = "truncate",
    pad_to_eos: bool = False,
) -> PromptBatch:
    """Tokenize and left-pad generation prompts to a common width of at most ``max_prompt_len`` tokens.

    A prompt longer than the limit keeps its last ``max_prompt_len`` tokens (``policy="truncate"``) or is
    left out (``policy="drop"``). Raises ``ValueError`` for an unknown policy, a missing pad token (see
    :func:`pad_token_id`), an empty prompt list, a prompt with no tokens, or when every prompt is dropped.
    """
    if policy not in PROMPT_POLICIES:
        raise ValueError(f"policy must be one of {list(PROMPT_POLICIES)}, got {policy!r}")
    if max_prompt_len <= 0:
        raise ValueError(f"max_prompt_len must be positive, got {max_prompt_len}")
    if not prompts:
        raise ValueError("prompt_batch needs at least one prompt")
    pad_id = pad_token_id(tok, pad_to_eos)
    rows: list[list[int]] = []
    kept: list[int] = []
    counts = {"truncated": 0, "dropped": 0}
    for index, prompt in enumerate(prompts):
        ids = _encode(tok, prompt)
        if not ids:
            raise ValueError(f"prompt {index} tokenizes to no tokens")
        if len(ids) > max_prompt_len:
            key = "truncated" if policy == "truncate" else "dropped"
            counts[key] += 1
            if policy == "drop":
                continue
            ids = ids[-max_prompt_len:]
        rows.append(ids)
        kept.append(index)
    if not rows:
        raise ValueError(f"all {len(prompts)} prompt(s) exceed max_prompt_len {max_prompt_len} and were dropped")
    input_ids = pad_sequences(rows, pad_id, left=True)
    mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(rows):
        mask[row, input_ids.shape[1] - len(ids):] = 1
    return PromptBatch(input_ids=input_ids, attention_mask=mask, counts=counts, kept=kept)
