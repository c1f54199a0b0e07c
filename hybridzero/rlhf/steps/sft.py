"""Step 1: supervised fine-tuning (causal-LM loss on prompt + response, masked to the response).

Runs on the current process group (``hybridzero.init_distributed()`` first; a plain process is a world of 1).
Each optimizer step consumes one global batch (``per_device_train_batch_size x world x accumulation``) of a seeded
per-epoch order; the loss of a micro-batch is the token mean over its response tokens (HF's ``labels`` loss).
Evaluation reports the token-mean loss and perplexity, summed over ranks, on each DeepSpeed-Chat dataset's own
test split (its share of the phase) where the copy has one, else on a held-out ``eval_fraction`` of the phase's data
(:func:`~hybridzero.rlhf.data.records.phase_train_eval`). The result is a Hugging Face directory in
``output_dir`` (weights, config, tokenizer) plus
``metrics.jsonl`` and TensorBoard scalars.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from hybridzero.comm.collectives import init_distributed
from hybridzero.packed_forward import check_packable, packed_lm_loss
from hybridzero.rlhf.data.records import phase_train_eval, train_eval_split, whole_records
from hybridzero.rlhf.data.tokens import IGNORE_INDEX, pad_sequences, pad_token_id, sft_example
from hybridzero.rlhf.engines import global_sum
from hybridzero.rlhf.models import add_eot_token, load_causal_lm, load_tokenizer, save_causal_lm
from hybridzero.rlhf.runlog.metrics import open_runlog
from hybridzero.rlhf.settings import SFTSettings
from hybridzero.rlhf.steps.supervised import LoopSpec, data_rank, run_loop, supervised_engine
from hybridzero.runtime.engine import Engine
from hybridzero.token_budget import budget_lm_backward, budget_lm_sums

__all__ = ["sft_batch", "train_sft"]


def sft_batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` / ``attention_mask`` / ``labels`` (-100 on prompt and padding)."""
    ids = pad_sequences([e[0] for e in examples], pad_id)
    labels = pad_sequences([e[1] for e in examples], IGNORE_INDEX)
    mask = pad_sequences([[1] * len(e[0]) for e in examples], 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _tokenize(
    records: list[dict[str, str]], tok: PreTrainedTokenizerBase, max_len: int
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """``(examples, truncated)``: SFT examples (``response``, or ``chosen`` of pairwise records)."""
    out, truncated = [], 0
    for r in records:
        ex = sft_example(tok, r["prompt"], r.get("response", r.get("chosen", "")), max_len)
        truncated += ex.n_truncated > 0
        out.append((ex.input_ids, ex.labels))
    return out, truncated


def _sums(engine: Engine, b: dict[str, torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(summed next-token cross-entropy, label-token count)`` of a padded SFT batch; under sequence parallelism
    over the whole rows (this rank's slice forwarded; the same numbers on every rank of the SP group)."""
    dev = engine.device
    sp = engine.sequence_parallel
    if sp is not None:
        part = {
            k: v.to(dev) for k, v in sp.shard_batch(b["input_ids"], b["labels"], b["attention_mask"], pad_id).items()
        }
        logits = engine(input_ids=part["input_ids"], position_ids=part["position_ids"], use_cache=False).logits
        return sp.token_sums(logits, part["shift_labels"])
    logits = engine(input_ids=b["input_ids"].to(dev), attention_mask=b["attention_mask"].to(dev)).logits.float()
    labels = b["labels"][:, 1:].to(dev)
    total = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total, (labels != IGNORE_INDEX).sum().to(total.dtype)


def _eval_sums(
    engine: Engine, part: list[tuple[list[int], list[int]]], pad_id: int, max_tokens: int | None
) -> tuple[float, float]:
    """``(nll sum, label tokens)`` of one eval batch: padded (SP: sliced) or, under a token budget, packed chunks."""
    if max_tokens is not None:
        return budget_lm_sums(engine, part, pad_id, max_tokens)
    total, count = _sums(engine, sft_batch(part, pad_id), pad_id)
    return float(total), float(count)


def _evaluate(
    engine: Engine,
    examples: list[tuple[list[int], list[int]]],
    pad_id: int,
    batch: int,
    max_tokens: int | None = None,
) -> dict[str, float]:
    """Token-mean loss and perplexity over ``examples`` (this data rank's strided share, summed over ranks);
    ``max_tokens`` (``--max_tokens_per_batch``): each eval batch forwarded in packed chunks of at most that many
    tokens (:func:`~hybridzero.token_budget.budget_lm_sums`, the same sums).

    Every rank runs the same number of forwards (ZeRO-3 forwards are collective): a rank whose share ran out
    scores a stand-in batch with weight 0; so do all but one rank of each SP group (they hold the group's sums).
    """
    rank, world = data_rank(engine)
    counted = engine.sequence_parallel is None or engine.sequence_parallel.rank == 0
    mine = examples[rank::world]
    rounds = math.ceil(math.ceil(len(examples) / world) / batch)
    nll, tokens = 0.0, 0.0
    engine.eval()
    with torch.no_grad():
        for i in range(rounds):
            chunk = mine[i * batch : (i + 1) * batch]
            weight = 1 if chunk and counted else 0
            part_nll, part_tokens = _eval_sums(engine, chunk or examples[:1], pad_id, max_tokens)
            nll += weight * part_nll
            tokens += weight * part_tokens
    engine.train()
    total_nll, total_tokens = global_sum(engine, [nll, tokens])
    mean = total_nll / max(total_tokens, 1.0)
    return {"eval_loss": mean, "perplexity": math.exp(min(mean, 50.0))}


def _reduce(engine: Engine, sums: dict[str, float]) -> dict[str, float]:
    """Global step metrics: the mean micro-batch loss and ``pad_fraction`` (padding share of the forward slots)."""
    loss, real, slots = global_sum(engine, [sums["loss"], sums["real"], sums["slots"]])
    return {"loss": loss / engine.comm.world_size, "pad_fraction": 1.0 - real / max(slots, 1.0)}


def train_sft(s: SFTSettings) -> dict[str, Any]:
    """Run step 1; returns the final metrics (on every rank) and writes ``s.output_dir``."""
    init_distributed()
    tok = load_tokenizer(s.model_name_or_path)
    if s.add_eot_token:
        add_eot_token(tok, s.eot_token)
    pad_id = pad_token_id(tok, pad_to_eos=True)  # a tokenizer without pad pads with eos (masks say what is real)
    model, hf_config = load_causal_lm(s.model_name_or_path, tok, s.seed, s.dropout)
    if s.packing_samples:  # before the engine: under sequence parallelism it switches the attention to Ulysses
        check_packable(hf_config)
    train_recs, eval_recs = phase_train_eval(
        s.data_path, s.data_split, 1, None, s.seed, s.data_root, s.eval_fraction
    )  # a DeepSpeed-Chat dataset's own test split where it has one, else a held-out eval_fraction
    if s.sft_only_data_path:
        only_train, only_eval = train_eval_split(
            whole_records(s.sft_only_data_path, s.data_root), s.eval_fraction, s.seed
        )
        train_recs, eval_recs = train_recs + only_train, eval_recs + only_eval
    engine, total, global_batch = supervised_engine(model, s, len(train_recs), "SFT training data")
    total_per_epoch = len(train_recs) // global_batch
    train_ex, cut = _tokenize(train_recs, tok, s.max_seq_len)
    eval_ex, _ = _tokenize(eval_recs, tok, s.max_seq_len)
    log = open_runlog(s.output_dir, engine.comm.rank, s.enable_tensorboard, s.progress, engine.monitor)
    log.print(
        f"SFT: {len(train_ex)} train / {len(eval_ex)} eval examples ({cut} truncated to {s.max_seq_len} "
        f"tokens), {total} steps of {global_batch} sequences at world {engine.comm.world_size}"
        f"{f' (sequence_parallel_size {s.sequence_parallel_size})' if s.sequence_parallel_size > 1 else ''}"
    )

    def micro_step(indices: list[int]) -> dict[str, float]:
        examples = [train_ex[i] for i in indices]
        if s.max_tokens_per_batch is not None:  # packed chunks of <= N tokens, backwarded inside (same loss)
            value, real, slots = budget_lm_backward(engine, examples, pad_id, s.max_tokens_per_batch, IGNORE_INDEX)
            return _finish(value, real, slots)
        if s.packing_samples:  # same sequences, same token-mean loss, no padding (hybridzero.packed_forward)
            loss, real, slots = packed_lm_loss(engine, examples, pad_id)
        elif engine.sequence_parallel is not None:  # each rank a slice of the padded rows, the whole rows' loss
            b = sft_batch(examples, pad_id)
            total, count = _sums(engine, b, pad_id)
            loss, real, slots = total / count.clamp(min=1.0), int(b["attention_mask"].sum()), b["input_ids"].numel()
        else:
            b = {n: v.to(engine.device) for n, v in sft_batch(examples, pad_id).items()}
            loss, real, slots = engine(**b).loss, int(b["attention_mask"].sum()), b["input_ids"].numel()
        engine.backward(loss)
        return _finish(float(loss.detach()), real, slots)

    def _finish(value: float, real: int, slots: int) -> dict[str, float]:
        if s.print_loss:
            print(
                f"Epoch: {engine.global_steps // max(total_per_epoch, 1)}, Step: {engine.global_steps}, "
                f"Rank: {engine.comm.rank}, loss = {value}",
                flush=True,
            )
        engine.step()
        return {"loss": value / s.gradient_accumulation_steps, "real": real, "slots": slots}

    spec = LoopSpec.from_settings(
        s,
        phase="sft",
        n_items=len(train_ex),
        total_steps=total,
        micro_step=micro_step,
        reduce=lambda sums: _reduce(engine, sums),
        evaluate=lambda: _evaluate(engine, eval_ex, pad_id, s.per_device_eval_batch_size, s.max_tokens_per_batch),
        step_line=lambda step, n, epoch, m: f"sft step {step}/{n} epoch {epoch} loss {m['loss']:.4f} lr {m['lr']:.2e}",
        eval_line=lambda epoch, ev: (
            f"sft epoch {epoch}: eval loss {ev['eval_loss']:.4f} perplexity {ev['perplexity']:.3f}"
        ),
    )
    metrics = run_loop(engine, spec, log)
    save_causal_lm(engine, s.output_dir, hf_config, tok)
    log.print(f"SFT: model saved to {s.output_dir}")
    log.close()
    return metrics
