"""Step 2: the reward model (a causal-LM trunk with a scalar value head scoring the last real token).

Each micro-batch stacks its chosen and rejected sequences (right-padded) into one forward; the loss is DeepSpeed-
Chat's pairwise ``-log sigmoid(score(chosen) - score(rejected))``, averaged over pairs. Reported per step and on the
evaluation records (a DeepSpeed-Chat dataset's test split where it has one, else a held-out ``eval_fraction``):
loss, accuracy (share of pairs with ``chosen > rejected``; ties count as wrong) and the mean chosen / rejected scores,
summed over ranks. The trunk starts from ``model_name_or_path`` (a causal-LM directory, e.g. step 1's
output; ``"demo"`` builds the demo model from scratch) and the head from a seeded draw.

Under sequence parallelism (``sequence_parallel_size`` s > 1) the ``s`` ranks of an SP group share their data rank's
micro-batch; each forwards its slice of the packed pairs and the scores are read from whole rows summed over the
group (:mod:`~hybridzero.rlhf.rollout.sp_values`), so the pairwise loss and accuracy are the ``s = 1`` numbers on
every rank of the group, and the engine's division by the world turns the group's gradients into the ``s = 1`` ones
(no extra scaling: the loss is a mean over the data rank's pairs). Metrics count each SP group once.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

from hybridzero.comm.collectives import init_distributed
from hybridzero.packed_forward import check_packable, packed_last_values
from hybridzero.rlhf.data.demo_task import demo_model_config
from hybridzero.rlhf.data.records import PAIRWISE_COLUMNS, phase_train_eval
from hybridzero.rlhf.data.tokens import pad_sequences, pad_token_id, pairwise_example
from hybridzero.rlhf.engines import data_sum
from hybridzero.rlhf.models import (
    ValueHeadModel,
    add_eot_token,
    fit_embeddings,
    last_token_index,
    load_tokenizer,
    load_value_model,
    save_value_model,
    set_dropout,
)
from hybridzero.rlhf.rollout.sp_values import sp_last_values
from hybridzero.rlhf.runlog.metrics import open_runlog
from hybridzero.rlhf.settings import RewardSettings
from hybridzero.rlhf.steps.supervised import LoopSpec, data_rank, run_loop, supervised_engine
from hybridzero.runtime.engine import Engine
from hybridzero.token_budget import budget_chunks

__all__ = ["pair_batch", "pair_stats", "train_reward"]

Pair = tuple[list[int], list[int]]


def pair_batch(pairs: list[Pair], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[2n, T]``: the n chosen rows, then the n rejected rows (right-padded)."""
    rows = [p[0] for p in pairs] + [p[1] for p in pairs]
    return pad_sequences(rows, pad_id), pad_sequences([[1] * len(r) for r in rows], 0)


def pair_stats(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """``(mean pairwise loss, sums)``: sums of loss, correct, chosen and rejected scores, and the pair count."""
    losses = -F.logsigmoid(chosen - rejected)
    sums = {
        "loss": float(losses.detach().sum()),
        "correct": float((chosen > rejected).sum()),
        "chosen": float(chosen.sum()),
        "rejected": float(rejected.sum()),
        "pairs": float(chosen.numel()),
    }
    return losses.mean(), sums


def _last_values(engine: Engine, ids: torch.Tensor, mask: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """``[B]`` values at each row's last real token from packed rows of ``capacity`` slots: split over the SP group
    under sequence parallelism (:func:`~hybridzero.rlhf.rollout.sp_values.sp_last_values`), else one packed forward
    (:func:`~hybridzero.packed_forward.packed_last_values`)."""
    if engine.sequence_parallel is not None:
        return sp_last_values(engine, ids, mask, capacity)
    return packed_last_values(engine, ids, mask, capacity=capacity)


def _scores(engine: Engine, pairs: list[Pair], pad_id: int, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen, rejected)`` ``[n]`` scores: values at each row's last real token, one forward for both
    (``packed``, and always under sequence parallelism: on packed rows, :func:`_last_values`)."""
    ids, mask = (t.to(engine.device) for t in pair_batch(pairs, pad_id))
    if packed or engine.sequence_parallel is not None:
        scores = _last_values(engine, ids, mask)
    else:
        values = engine(input_ids=ids, attention_mask=mask)
        scores = values.gather(1, last_token_index(mask)[:, None]).squeeze(1)
    return scores[: len(pairs)], scores[len(pairs) :]


def budget_pair_backward(engine: Engine, pairs: list[Pair], pad_id: int, max_tokens: int) -> dict[str, float]:
    """Forward and backward of a pairwise micro-batch in chunks of whole pairs (chosen + rejected: the loss's unit)
    holding ``<= max_tokens`` tokens; each chunk's mean pair loss is weighted by its share of the micro-batch's pairs,
    so the chunks' losses sum to the micro-batch's mean (:mod:`hybridzero.token_budget`). Returns the pair sums."""
    lengths = [len(c) + len(r) for c, r in pairs]
    total = dict.fromkeys(("loss", "correct", "chosen", "rejected", "pairs"), 0.0)
    with engine.backward_group():
        for chunk in budget_chunks(engine, lengths, max_tokens, "pair (chosen + rejected)"):
            part = [pairs[i] for i in chunk.rows]
            ids, mask = (t.to(engine.device) for t in pair_batch(part, pad_id))
            scores = _last_values(engine, ids, mask, max_tokens)
            loss, sums = pair_stats(scores[: len(part)], scores[len(part) :])
            engine.backward(loss * (chunk.weight * len(part) / len(pairs)))
            for key in total:
                total[key] += chunk.weight * sums[key]
    return total


def _reduce(engine: Engine, sums: dict[str, float], prefix: str = "") -> dict[str, float]:
    """Global means of the per-pair sums (each SP group counted once: :func:`~hybridzero.rlhf.engines.data_sum`)."""
    keys = ("loss", "correct", "chosen", "rejected", "pairs")
    total = dict(zip(keys, data_sum(engine, [sums[k] for k in keys])))
    n = max(total["pairs"], 1.0)
    return {
        f"{prefix}loss": total["loss"] / n,
        f"{prefix}accuracy": total["correct"] / n,
        f"{prefix}chosen_score": total["chosen"] / n,
        f"{prefix}rejected_score": total["rejected"] / n,
    }


def _budget_scores(
    engine: Engine, pairs: list[Pair], pad_id: int, max_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_scores` forwarded in packed chunks of whole pairs holding ``<= max_tokens`` tokens (evaluation under
    ``--max_tokens_per_batch``); stand-in chunks' scores are dropped."""
    chosen, rejected = torch.zeros(len(pairs)), torch.zeros(len(pairs))
    for chunk in budget_chunks(engine, [len(c) + len(r) for c, r in pairs], max_tokens, "pair (chosen + rejected)"):
        ids, mask = (t.to(engine.device) for t in pair_batch([pairs[i] for i in chunk.rows], pad_id))
        scores = _last_values(engine, ids, mask, max_tokens).float().cpu()
        if chunk.weight:
            rows = torch.tensor(chunk.rows)
            chosen[rows], rejected[rows] = scores[: len(rows)], scores[len(rows) :]
    return chosen, rejected


def _evaluate(
    engine: Engine, pairs: list[Pair], pad_id: int, batch: int, max_tokens: int | None = None
) -> dict[str, float]:
    """Held-out metrics; every rank runs the same number of forwards (a finished rank scores weight-0 stand-ins).
    ``max_tokens``: each eval batch scored in packed chunks (:func:`_budget_scores`). Pairs are dealt by data rank
    (the ranks of an SP group score the same pairs, split by sequence)."""
    rank, world = data_rank(engine)
    mine = pairs[rank::world]
    rounds = math.ceil(math.ceil(len(pairs) / world) / batch)
    sums = dict.fromkeys(("loss", "correct", "chosen", "rejected", "pairs"), 0.0)
    engine.eval()
    with torch.no_grad():
        for i in range(rounds):
            chunk = mine[i * batch : (i + 1) * batch]
            part = chunk or pairs[:1]
            if max_tokens is not None:
                chosen, rejected = _budget_scores(engine, part, pad_id, max_tokens)
            else:
                chosen, rejected = _scores(engine, part, pad_id)
            if chunk:
                for k, v in pair_stats(chosen, rejected)[1].items():
                    sums[k] += v
    engine.train()
    return _reduce(engine, sums, "eval_")


def _build_model(s: RewardSettings, tok: PreTrainedTokenizerBase) -> ValueHeadModel:
    """The value model: from a model directory, or the demo config from scratch (seeded)."""
    if s.model_name_or_path == "demo":
        torch.manual_seed(s.seed)
        return ValueHeadModel(set_dropout(demo_model_config(tok), s.dropout), head_seed=s.seed)
    model = load_value_model(s.model_name_or_path, head_seed=s.seed, dropout=s.dropout)
    if fit_embeddings(model.transformer, len(tok), s.seed) != model.config.vocab_size:  # --add_eot_token's token
        model.config.vocab_size = cast(Any, model.transformer).config.vocab_size
    return model


def train_reward(s: RewardSettings) -> dict[str, Any]:
    """Run step 2; returns the final metrics (every rank) and writes the value model to ``s.output_dir``."""
    init_distributed()
    tok = load_tokenizer(s.model_name_or_path)
    if s.add_eot_token:
        add_eot_token(tok, s.eot_token)
    pad_id = pad_token_id(tok, pad_to_eos=True)  # a tokenizer without pad pads with eos (masks say what is real)
    model = _build_model(s, tok).float()
    if s.packing_samples:  # before the engine: under sequence parallelism it switches the attention to Ulysses
        check_packable(model.config)
    train_recs, eval_recs = phase_train_eval(
        s.data_path, s.data_split, 2, PAIRWISE_COLUMNS, s.seed, s.data_root, s.eval_fraction
    )  # a DeepSpeed-Chat dataset's own test split where it has one, else a held-out eval_fraction
    engine, total, global_batch = supervised_engine(model, s, len(train_recs), "reward-model training pairs")
    encode = [
        pairwise_example(tok, r["prompt"], r["chosen"], r["rejected"], s.max_seq_len) for r in train_recs + eval_recs
    ]
    pairs: list[Pair] = [(e.chosen_ids, e.rejected_ids) for e in encode]
    train_pairs, eval_pairs = pairs[: len(train_recs)], pairs[len(train_recs) :]
    log = open_runlog(s.output_dir, engine.comm.rank, s.enable_tensorboard, s.progress, engine.monitor)
    cut = sum(e.n_truncated > 0 for e in encode)
    log.print(
        f"reward: {len(train_pairs)} train / {len(eval_pairs)} eval pairs ({cut} truncated to "
        f"{s.max_seq_len} tokens), {total} steps of {global_batch} pairs at world {engine.comm.world_size}"
        f"{f' (sequence_parallel_size {s.sequence_parallel_size})' if s.sequence_parallel_size > 1 else ''}"
    )

    def micro_step(indices: list[int]) -> dict[str, float]:
        if s.max_tokens_per_batch is not None:
            sums = budget_pair_backward(engine, [train_pairs[i] for i in indices], pad_id, s.max_tokens_per_batch)
            engine.step()
            return sums
        chosen, rejected = _scores(engine, [train_pairs[i] for i in indices], pad_id, s.packing_samples)
        loss, sums = pair_stats(chosen, rejected)
        engine.backward(loss)
        engine.step()
        return sums

    spec = LoopSpec.from_settings(
        s,
        phase="reward",
        n_items=len(train_pairs),
        total_steps=total,
        micro_step=micro_step,
        reduce=lambda sums: _reduce(engine, sums),
        evaluate=lambda: _evaluate(engine, eval_pairs, pad_id, s.per_device_eval_batch_size, s.max_tokens_per_batch),
        step_line=lambda step, n, epoch, m: (
            f"reward step {step}/{n} loss {m['loss']:.4f} "
            f"acc {m['accuracy']:.3f} chosen {m['chosen_score']:.3f} "
            f"rejected {m['rejected_score']:.3f}"
        ),
        eval_line=lambda epoch, ev: (
            f"reward epoch {epoch}: held-out accuracy {ev['eval_accuracy']:.3f} "
            f"loss {ev['eval_loss']:.4f} chosen {ev['eval_chosen_score']:.3f} "
            f"rejected {ev['eval_rejected_score']:.3f}"
        ),
    )
    metrics = run_loop(engine, spec, log)
    save_value_model(engine, s.output_dir, tok)
    log.print(f"reward: model saved to {s.output_dir}")
    log.close()
    return metrics
