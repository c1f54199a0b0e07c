"""Reward functions of the arithmetic demo, in TRL's reward-function signature.

``fn(prompts=..., completions=..., completion_ids=..., **dataset_columns) -> list[float | None]``: one float per
completion, in order. The same module serves ``hybridzero grpo --reward_funcs
hybridzero.rlhf.demo.rewards:exact_answer`` and TRL's ``GRPOTrainer(reward_funcs=[exact_answer])``
(``bench/bench_rl_peers.py`` runs both). Completions are plain strings (TRL's "standard" format); extra dataset
columns (``answer``) arrive as keyword lists and are ignored: the checker derives the answer from the prompt, so a
trainer that does not pass columns scores the same. Pure functions: no state, no ``eval`` of data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridzero.rlhf.demo.arith import exact_score, format_score

__all__ = ["exact_answer", "answer_format"]


def _check(prompts: Sequence[Any], completions: Sequence[Any]) -> None:
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    for c in completions:
        if not isinstance(c, str):
            raise TypeError(f"completions must be strings (TRL's standard format), got {type(c).__name__}")


def exact_answer(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float | None]:
    """1.0 when the completion is exactly the sum (:func:`hybridzero.rlhf.demo.arith.exact_score`), else 0.0."""
    _check(prompts, completions)
    return [exact_score(p, c) for p, c in zip(prompts, completions)]


def answer_format(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float | None]:
    """1.0 when the completion looks like an answer (digits only, plausible length), else 0.0
    (:func:`hybridzero.rlhf.demo.arith.format_score`)."""
    _check(prompts, completions)
    return [format_score(p, c) for p, c in zip(prompts, completions)]
