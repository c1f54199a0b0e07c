"""RLHF tokenization: SFT and pairwise sequences, generation prompts (step 3's within their budget), padding.

Token layouts: SFT and pairwise sequences are ``prompt + answer + eos`` (no other special tokens, unpadded);
generation prompts are left-padded to a common width.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hybridzero.rlhf.data.records import phase_records
from hybridzero.rlhf.settings import PPOSettings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX: int = -100
PROMPT_POLICIES: tuple[str, ...] = ("truncate", "drop")


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
    for name, value in (
        ("model_context", model_context),
        ("max_prompt_len", max_prompt_len),
        ("max_answer_len", max_answer_len),
    ):
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
    kept_prompt = prompt_ids[len(prompt_ids) - n_prompt :]
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
        out[row, start : start + len(seq)] = torch.tensor(list(seq), dtype=torch.long)
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
        mask[row, input_ids.shape[1] - len(ids) :] = 1
    return PromptBatch(input_ids=input_ids, attention_mask=mask, counts=counts, kept=kept)


def prompt_tensors(
    tok: PreTrainedTokenizerBase, prompts: Sequence[str], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(input_ids, attention_mask)`` of already budget-checked prompts."""
    rows = [tok.encode(p, add_special_tokens=False) for p in prompts]
    ids = pad_sequences(rows, pad_id, left=True)
    mask = pad_sequences([[1] * len(r) for r in rows], 0, left=True)
    return ids, mask


def load_prompts(s: PPOSettings, tok: PreTrainedTokenizerBase, model_context: int) -> tuple[list[str], dict[str, int]]:
    """The phase-3 prompts within ``max_prompt_seq_len`` tokens (``prompt_policy`` drop or truncate, counted)."""
    prompts, _, counts = load_prompt_rows(s, tok, model_context)
    return prompts, counts


def load_prompt_rows(
    s: PPOSettings, tok: PreTrainedTokenizerBase, model_context: int
) -> tuple[list[str], list[dict[str, Any]], dict[str, int]]:
    """:func:`load_prompts` plus each kept prompt's other columns (the reward functions' ``**columns``)."""
    check_budget(model_context, s.max_prompt_seq_len, s.max_answer_seq_len)
    records = phase_records(s.data_path, s.data_split, 3, ("prompt",), s.seed, s.data_root, keep_extra=True)
    prompts: list[str] = []
    extras: list[dict[str, Any]] = []
    counts = {"dropped": 0, "truncated": 0, "empty": 0}
    for r in records:
        ids = tok.encode(r["prompt"], add_special_tokens=False)
        if not ids:
            counts["empty"] += 1
            continue
        if len(ids) > s.max_prompt_seq_len:
            if s.prompt_policy == "drop":
                counts["dropped"] += 1
                continue
            counts["truncated"] += 1
            r = {**r, "prompt": str(tok.decode(ids[-s.max_prompt_seq_len :]))}
        prompts.append(r["prompt"])
        extras.append({k: v for k, v in r.items() if k != "prompt"})
    if not prompts:
        raise ValueError(f"no usable step-3 prompts: {counts} (max_prompt_seq_len {s.max_prompt_seq_len})")
    return prompts, extras, counts
