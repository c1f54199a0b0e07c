"""Helpers shared by ``bench/bench_generate.py`` and its peer ranks (``bench/generate_peers.py``).

Every system generates with :func:`greedy_generate` from the prompts of :func:`prompts_for` on the model of
:func:`load_model`; a rank's timed calls come from :func:`timed_calls` and become one result row through
:func:`ranks_row` (a call's time is its slowest rank's; tokens are rank 0's, compared with plain ``generate``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

MB = 1e6


def load_model(name: str) -> torch.nn.Module:
    """The benchmark Llama variant ``name`` (``bench``, ``tiny`` or ``100m``), seed 0, in eval mode."""
    from bench_model import benchmark_llama, model_overrides

    model = benchmark_llama(0, **model_overrides(name))
    model.eval()
    return model


def prompts_for(rank: int, batch: int, prompt_len: int, vocab: int) -> torch.Tensor:
    """Random prompt ids ``[batch, prompt_len]`` of ``rank`` (private generator; avoids the special ids 0-2)."""
    generator = torch.Generator().manual_seed(1234 + rank)
    return torch.randint(3, vocab, (batch, prompt_len), generator=generator, dtype=torch.int64)


def greedy_generate(model: Any, prompts: torch.Tensor, new_tokens: int, **extra: Any) -> torch.Tensor:
    """Greedy, KV-cached generation of exactly ``new_tokens`` tokens with ``model.generate`` (``extra`` passed on)."""
    with torch.no_grad():
        return model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
            **extra,
        )


class ForwardCounter:
    """Counts forwards of a root module through a forward hook while it is registered (``count`` is public)."""

    def __init__(self, module: torch.nn.Module) -> None:
        """Register the hook on ``module``; :meth:`remove` takes it off."""
        self.count = 0
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """One more forward of the root."""
        self.count += 1

    def remove(self) -> None:
        """Unregister the hook."""
        self._handle.remove()


def timed_calls(
    run: Callable[[], torch.Tensor],
    repeats: int,
    counter: ForwardCounter | None = None,
    reset: Callable[[], None] | None = None,
) -> tuple[list[float], torch.Tensor]:
    """One warm-up ``run()``, then ``repeats`` timed ones, each after a barrier (when distributed), ``reset()`` and
    zeroing ``counter``; the seconds per timed call and the last call's output."""
    out = run()  # warm-up
    seconds = []
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    for _ in range(repeats):
        if distributed:
            torch.distributed.barrier()
        if counter is not None:
            counter.count = 0
        if reset is not None:
            reset()
        start = time.perf_counter()
        out = run()
        seconds.append(time.perf_counter() - start)
    return seconds, out


def summarize(system: str, world: int, per_call: list[float], settings: dict[str, Any]) -> dict[str, Any]:
    """One result row from the per-call seconds (already the slowest rank's for a multi-rank system)."""
    median = statistics.median(per_call)
    per_rank = settings["batch"] * settings["new_tokens"] / median
    return {
        "system": system,
        "world_size": world,
        "median_s": median,
        "min_s": min(per_call),
        "max_s": max(per_call),
        "seconds": per_call,
        "tokens_per_s_per_rank": per_rank,
        "tokens_per_s_all_ranks": per_rank * world,
    }


def ranks_row(
    system: str, ranks: list[dict[str, Any]], settings: dict[str, Any], plain_tokens: torch.Tensor
) -> dict[str, Any]:
    """Summarise one multi-rank system from its ranks' results (``seconds``, ``forwards``, ``gather_calls``,
    ``gather_bytes``, rank 0's ``tokens``): slowest rank per call, rank 0's counts, tokens vs plain generate."""
    per_call = [max(r["seconds"][i] for r in ranks) for i in range(settings["repeats"])]
    row = summarize(system, len(ranks), per_call, settings)
    gather_bytes = ranks[0].get("gather_bytes")
    held = ranks[0].get("held_bytes")
    row.update(
        held_mb=None if held is None else held / MB,
        forwards=ranks[0].get("forwards"),
        all_gather_calls=ranks[0].get("gather_calls"),
        all_gather_mb=None if gather_bytes is None else gather_bytes / MB,
        tokens_match_plain=bool(torch.equal(ranks[0]["tokens"], plain_tokens)),
    )
    return row
