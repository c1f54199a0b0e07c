"""Stop strings for generation: stop a row once its answer text contains one, and cut the answer right after it.

Two halves, both on decoded text (token boundaries need not match the string's):

* :class:`StopOnStrings` is a Hugging Face stopping criterion: after each decoding step it decodes every row's
  answer so far and marks the rows whose text contains a stop string as done (``generate`` ends when all rows are
  done, or at the length limit). It only saves decoding steps; correctness comes from the cut.
* :func:`cut_after_stop` returns, per row, the shortest answer prefix whose text contains a stop string: tokens after
  it are masked (the answer ends with the stop string, as HF's ``stop_strings`` leaves it). Rows without one keep
  their length.

Decoding skips special tokens (a pad or EOS never hides or forms a stop string). The cost is one decode per row and
step (generation) and, for a row that stopped, one decode per prefix length (the cut): small next to a forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import StoppingCriteria

__all__ = ["StopOnStrings", "cut_after_stop"]


def _text(tok: Any, ids: Sequence[int]) -> str:
    return str(tok.decode(list(ids), skip_special_tokens=True))


class StopOnStrings(StoppingCriteria):
    """Done per row once the answer (tokens from ``prompt_width`` on) contains any of ``stops``."""

    def __init__(self, tok: Any, stops: Sequence[str], prompt_width: int) -> None:
        if not stops or any(not s for s in stops):
            raise ValueError(f"stop_strings {list(stops)!r}: every stop string must be non-empty")
        self.tok, self.stops, self.prompt_width = tok, tuple(stops), prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``[B]`` bool: the rows whose answer text contains a stop string."""
        rows = input_ids[:, self.prompt_width :].tolist()
        done = [any(s in _text(self.tok, row) for s in self.stops) for row in rows]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def cut_after_stop(tok: Any, answers: torch.Tensor, lengths: torch.Tensor, stops: Sequence[str]) -> torch.Tensor:
    """``[B]`` new lengths: for each row of ``answers [B, A]`` (valid up to ``lengths[b]``), the fewest tokens whose
    text contains a stop string; ``lengths[b]`` when none does. Never longer than the input length."""
    out = lengths.clone()
    for b, row in enumerate(answers.tolist()):
        n = int(lengths[b])
        if not any(s in _text(tok, row[:n]) for s in stops):
            continue
        for m in range(1, n + 1):
            if any(s in _text(tok, row[:m]) for s in stops):
                out[b] = m
                break
    return out
