"""Pieces the demos share: generating held-out answers dealt over the ranks, and writing a run's report.

Both are collective-free apart from the actor's own generation (``evaluate_*`` callers reduce their sums with
``global_sum``); every rank must call :func:`held_out_answers` with the same arguments.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from hybridzero.rlhf.data.tokens import prompt_tensors
from hybridzero.rlhf.rollout.generate import rollout
from hybridzero.rlhf.runlog.plot import PlotsUnavailable, plot_run
from hybridzero.runtime.engine import Engine

__all__ = ["held_out_answers", "write_report"]


def held_out_answers(
    actor: Engine,
    tok: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    rank: int,
    world: int,
    seed: int,
    prompt_width: int,
    answer_len: int,
    do_sample: bool,
) -> tuple[list[int], Any, list[str]]:
    """``(mine, rollout, answers)``: this rank's prompts (indices ``i ≡ rank mod world``), their rollout and each
    answer decoded without special tokens. Sampling is seeded per sample id, so answers do not depend on ``world``."""
    mine = list(range(rank, len(prompts), world))
    ids, mask = prompt_tensors(tok, [prompts[i] for i in mine], int(tok.pad_token_id))
    ro = rollout(
        actor.generate,
        ids,
        mask,
        sample_ids=mine,
        run_seed=seed,
        prompt_width=prompt_width,
        answer_len=answer_len,
        pad_id=int(tok.pad_token_id),
        eos_id=tok.eos_token_id,
        do_sample=do_sample,
    )
    answers = [
        str(tok.decode(row[prompt_width:][m[prompt_width:].bool()].tolist(), skip_special_tokens=True))
        for row, m in zip(ro.sequences, ro.attention_mask)
    ]
    return mine, ro, answers


def write_report(out: Path, run_dirs: Sequence[str], summary: dict[str, Any], echo: Callable[[str], None]) -> list[str]:
    """Rank 0's report: every step's plots (skipped with a note when matplotlib is missing), recorded in
    ``summary["plots"]``, then ``out/summary.json``. Returns the plot paths."""
    try:
        plots = [str(p) for d in run_dirs for p in plot_run(Path(d))]
    except PlotsUnavailable as exc:
        plots = []
        echo(f"plots skipped: {exc}")
    summary["plots"] = plots
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return plots
