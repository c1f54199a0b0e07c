"""The language-model head on the wanted positions only.

An RL update or scoring pass needs next-token log-probabilities at the answer's positions only, yet a causal LM's
forward projects every slot of its rows (prompt, answer, padding) through the output head and the log-softmax over
the whole vocabulary. On SmolLM2-135M (vocabulary 49,152, hidden 576) the head is about a fifth of a training
forward's work, and the prompt and padding slots are more than half of the slots, so most of that work is thrown away.
TRL's GRPOTrainer passes ``logits_to_keep`` (the answer's columns) for the same reason; that keeps a column range
shared by all rows, which packed rows do not have. Here the head's *input* is cut to the wanted slots instead: a
forward pre-hook on the model's output embeddings (``get_output_embeddings()``, torch's public hook API, registered
for one forward and removed after it) replaces the hidden states ``[R, W, H]`` by ``hidden[keep]`` as one ``[1, n,
H]`` row, so the head, any elementwise logit transform after it (soft-capping, scaling) and the log-softmax see
``n`` rows instead of ``R * W``.

Invariants (``tests/unit/test_head_select.py``): the log-probability at a kept slot is the full forward's at that
slot up to the head matmul's summation blocking (the same function of the same hidden state); every other slot is
0 and takes no gradient; a model without output embeddings, or whose head does not see ``[R, W, H]`` hidden states
(the hook then leaves it alone), gets the full logits and the same selection after them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["kept_logits", "next_token_logprobs_at", "output_head"]


def output_head(model: Callable[..., Any]) -> nn.Module | None:
    """``model``'s output embeddings (an engine's: its module's), or ``None`` where it has none."""
    module = getattr(model, "module", model)
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None


@contextmanager
def _head_input_cut(head: nn.Module, keep: torch.Tensor) -> Iterator[list[int]]:
    """While active, ``head``'s input ``[R, W, H]`` (``R, W = keep.shape``) becomes ``hidden[keep]`` as ``[1, n, H]``;
    yields a list that holds ``n`` once the cut happened."""
    done: list[int] = []

    def cut(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        hidden = args[0] if args else None
        if done or not isinstance(hidden, torch.Tensor) or tuple(hidden.shape[:-1]) != tuple(keep.shape):
            return None
        picked = hidden[keep.to(hidden.device)].unsqueeze(0)
        done.append(int(picked.shape[1]))
        return (picked, *args[1:])

    handle = head.register_forward_pre_hook(cut)
    try:
        yield done
    finally:
        handle.remove()


def kept_logits(model: Callable[..., Any], kwargs: dict[str, Any], keep: torch.Tensor) -> torch.Tensor:
    """``[n, V]``: ``model(**kwargs).logits`` at the ``n`` slots where ``keep [R, W]`` is True (row-major order),
    the head run on those slots only where it can be (module docstring)."""
    keep = keep.to(torch.bool)
    head = output_head(model)
    if head is None:
        return model(**kwargs).logits[keep]
    with _head_input_cut(head, keep) as done:
        logits = model(**kwargs).logits
    if done and tuple(logits.shape[:2]) == (1, done[0]):
        return logits[0]
    return logits[keep.to(logits.device)]


def next_token_logprobs_at(
    model: Callable[..., Any], kwargs: dict[str, Any], ids: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """``[R, W]`` fp32: at a kept slot ``j`` of row ``r``, ``log p(ids[r, j + 1] | ...)``; 0 elsewhere. ``keep`` must
    be False on every row's last column (no next token there)."""
    keep = keep.to(device=ids.device, dtype=torch.bool)
    if bool(keep[:, -1].any()):
        raise ValueError("next_token_logprobs_at: keep selects a row's last slot, which has no next token")
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)[keep]
    logits = kept_logits(model, kwargs, keep)
    wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    picked = wide.gather(-1, nxt[:, None].to(wide.device)).squeeze(-1) - torch.logsumexp(wide, dim=-1)
    out = torch.zeros(keep.shape, dtype=picked.dtype, device=picked.device)
    out[keep.to(picked.device)] = picked
    return out
