"""Toy reward functions (TRL's signature) for the RL-with-verifiable-rewards tests, importable by spec
(``tests.workers.rlvr_rewards:digit_share``) in the test process and in spawned ranks.

The failing ones misbehave only where the ``RLVR_FAIL_RANK`` environment variable names this process's rank
(``RANK``), so a world-2 test can make one rank raise, hang or return NaN while the other behaves.
"""

from __future__ import annotations

import os
import time
from typing import Any


def digit_share(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """Share of the answer's characters that are digits (0 for an empty answer): varies within a group."""
    return [sum(c.isdigit() for c in a) / len(a) if a else 0.0 for a in completions]


def matches_target(completions: list[str], target: list[Any] | None = None, **kwargs: Any) -> list[float | None]:
    """1 when the answer (spaces removed) equals the row's ``target`` column, 0 otherwise; None without one."""
    targets = target if target is not None else [None] * len(completions)
    return [
        None if t is None else float(a.replace(" ", "") == str(t).replace(" ", ""))
        for a, t in zip(completions, targets)
    ]


def length_bonus(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Answer length in tokens / 10."""
    return [len(ids) / 10 for ids in completion_ids]


def _failing_here() -> bool:
    return os.environ.get("RLVR_FAIL_RANK") == os.environ.get("RANK", "0")


def raise_on_rank(completions: list[str], **kwargs: Any) -> list[float]:
    """Raises on the failing rank; ``digit_share`` elsewhere."""
    if _failing_here():
        raise RuntimeError("checker crashed")
    return digit_share([], completions)


def hang_on_rank(completions: list[str], **kwargs: Any) -> list[float]:
    """Never returns on the failing rank (sleeps); ``digit_share`` elsewhere."""
    if _failing_here():
        time.sleep(3600)
    return digit_share([], completions)


def nan_on_rank(completions: list[str], **kwargs: Any) -> list[float]:
    """NaN for the second sample on the failing rank; ``digit_share`` elsewhere."""
    values = digit_share([], completions)
    if _failing_here():
        values[1] = float("nan")
    return values


def nan_everywhere(completions: list[str], **kwargs: Any) -> list[float]:
    """NaN for every sample on every rank (with ``reward_error_policy="skip"``: a batch with no training token)."""
    return [float("nan")] * len(completions)


def first_is_digit(completions: list[str], **kwargs: Any) -> list[float]:
    """1 when the answer starts with a digit: coarse, so whole groups often tie (DAPO's dynamic sampling)."""
    return [float(bool(a) and a[0].isdigit()) for a in completions]


def nothing_after_equals(completions: list[str], **kwargs: Any) -> list[float]:
    """1 when no text follows an ``=`` (what a stop string ``=`` must guarantee), else 0."""
    return [float("=" not in a or a.rstrip().endswith("=")) for a in completions]
