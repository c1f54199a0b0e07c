"""Held-out scoring of a policy on the arithmetic demo: exact rate, dropped-carry rate, format rate.

Prompts are dealt over ranks (rank ``r`` takes ``r, r + W, ...``), generated through the hybrid engine with
:func:`hybridzero.rlhf.rollout.generate.rollout` (each sample seeded by its global index, so greedy results do not
depend on
the world size and sampled ones only through floating-point reduction order), scored with the exact checker, and
summed over ranks: every rank returns the same global means.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridzero.rlhf.demo.arith import arith_data_dir, exact_score, format_score, is_dropped_carry, needs_carry
from hybridzero.rlhf.demo.report import held_out_answers
from hybridzero.rlhf.engines import ds_config, global_sum, load_actor_engine, world_comm
from hybridzero.rlhf.models import load_tokenizer

__all__ = ["PROMPT_WIDTH", "ANSWER_LEN", "eval_prompts", "evaluate_arith"]

PROMPT_WIDTH = 8  # 5 digits, "=", one digit, "="
ANSWER_LEN = 8  # at most 6 digits and eos


def eval_prompts(limit: int | None = None) -> list[str]:
    """The shipped held-out prompts (the first ``limit`` of them when given)."""
    path = arith_data_dir() / "eval_prompts.jsonl"
    rows = [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines()]
    return rows[:limit] if limit is not None else rows


def evaluate_arith(actor_dir: str | Path, prompts: list[str], *, do_sample: bool, seed: int = 99) -> dict[str, float]:
    """Global means over ``prompts`` of the policy in ``actor_dir``: ``exact``, ``exact_carry`` (on the prompts
    that need a carry), ``dropped_carry`` (share of carry prompts answered with the demonstrations' habit) and
    ``format``. Collective: every rank must call it with the same arguments."""
    comm = world_comm()
    world, rank = comm.world_size, comm.rank
    tok = load_tokenizer(str(actor_dir))
    actor = load_actor_engine(str(actor_dir), ds_config(stage=3, dtype="fp32", micro_batch=1, world_size=world), False)
    mine, _, answers = held_out_answers(
        actor,
        tok,
        prompts,
        rank=rank,
        world=world,
        seed=seed,
        prompt_width=PROMPT_WIDTH,
        answer_len=ANSWER_LEN,
        do_sample=do_sample,
    )
    pairs = [(prompts[i], a) for i, a in zip(mine, answers)]
    carry = [(p, a) for p, a in pairs if needs_carry(p)]
    sums = global_sum(
        actor,
        [
            sum(exact_score(p, a) for p, a in pairs),
            sum(format_score(p, a) for p, a in pairs),
            float(len(pairs)),
            sum(exact_score(p, a) for p, a in carry),
            sum(float(is_dropped_carry(p, a)) for p, a in carry),
            float(len(carry)),
        ],
    )
    n, nc = max(sums[2], 1.0), max(sums[5], 1.0)
    return {"exact": sums[0] / n, "format": sums[1] / n, "exact_carry": sums[3] / nc, "dropped_carry": sums[4] / nc}
