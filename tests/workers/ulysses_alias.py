"""Per-rank bodies of the DeepSpeed-named Ulysses (ALST) tests: Hugging Face's flow through the ``deepspeed`` alias.

The model: a 2-block Llama with SDPA attention, 2 query heads sharing 1 kv head (repeated under s = 2), head_dim 6,
hidden 38, intermediate 67, vocabulary 113 (none divisible by 3 or 4; only the heads and the hidden size -- HF wants
it a multiple of the heads -- by 2). Every rank's loader yields dict batches of ``MICRO`` rows of ``SEQ`` = 13 tokens
(odd: the adapter right-pads to 14); row 1 of every batch is right-padded after 9 tokens (attention_mask 0, labels
-100), as a collator pads.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from tests.harness.models import tiny_llama

SEQ, MICRO, STEPS, LR, REAL = 13, 2, 3, 0.1, 9


def ulysses_model() -> torch.nn.Module:
    """The tiny SDPA Llama of this file (same weights on every rank and in every run)."""
    return tiny_llama(
        0, num_attention_heads=2, num_key_value_heads=1, head_dim=6, hidden_size=38, attn_implementation="sdpa"
    )


def loader_batches(rank: int, world: int, steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    """Rank ``rank``'s batches: batch ``t`` is global batch ``t W + rank`` (a sequential loader sharded by rank)."""
    gen = torch.Generator().manual_seed(4321)
    ids = torch.randint(3, 113, (steps * world, MICRO, SEQ), generator=gen)
    out = []
    for index in range(rank, steps * world, world):
        row = ids[index].clone()
        mask = torch.ones_like(row)
        mask[1, REAL:] = 0
        row[1, REAL:] = 0
        labels = row.masked_fill(mask == 0, -100)
        out.append({"input_ids": row, "attention_mask": mask, "labels": labels})
    return out


def ds_config(world: int, sp: int, accumulation: int) -> dict[str, Any]:
    """Stage 3, SGD; the batch is ``MICRO * accumulation * world / sp`` (DeepSpeed's with an SP mpu)."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": MICRO * accumulation * world // sp,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
    }


def reference_run() -> dict[str, Any]:
    """s = 1 at this world (every rank its own batch, one micro-batch per step): this rank's losses."""
    import hybridzero

    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    engine, *_ = hybridzero.initialize(model=ulysses_model(), config=ds_config(world, 1, 1))
    losses = []
    for batch in loader_batches(rank, world):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return {"losses": losses}


def _alias_probe(groups: Any, mpu: Any) -> dict[str, Any]:
    """What ``deepspeed.utils.groups`` and the mpu report (the getters Accelerate and Trainer call)."""
    return {
        "sp": (groups._get_sequence_parallel_world_size(), groups._get_sequence_parallel_rank()),
        "dp": (groups._get_data_parallel_world_size(), groups._get_data_parallel_rank()),
        "sdp": (groups._get_sequence_data_parallel_world_size(), groups._get_sequence_data_parallel_rank()),
        "same_group": groups._get_sequence_parallel_group() is mpu.get_sequence_parallel_group(),
        "mpu": (mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()),
    }


def ds_named_run() -> dict[str, Any]:
    """s = 2 through DeepSpeed's names only, as Accelerate's ALST path drives them: register_with_transformers,
    initialize(mpu=...), UlyssesSPDataLoaderAdapter over this rank's loader, Hugging Face's SP loss aggregation
    (``transformers.integrations.deepspeed.deepspeed_sp_compute_loss``), two micro-batches per step."""
    from hybridzero.deepspeed_alias import install, uninstall

    assert install()
    try:
        return _ds_named_body()
    finally:
        uninstall()


def _ds_named_body() -> dict[str, Any]:
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups
    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

    deepspeed.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    before = _alias_probe(groups, SimpleNamespace(get_sequence_parallel_group=lambda: None, **_no_mpu()))
    model = ulysses_model()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=2,
        micro_batch_size=MICRO,
        seq_length=None,
        seq_length_is_variable=True,
        disable_in_eval=True,
    )
    impl_during = model.config._attn_implementation
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(world, 2, 2), mpu=mpu)
    eval_diff = _eval_gap(engine)
    dl = UlyssesSPDataLoaderAdapter(
        loader_batches(rank, world),
        sp_rank=mpu.get_sequence_parallel_rank(),
        sp_group=mpu.get_sequence_parallel_group(),
        sp_world_size=mpu.get_sequence_parallel_world_size(),
        device=torch.device("cpu"),
    )
    pc = SimpleNamespace(sp_backend="deepspeed", sp_size=2)
    losses, shapes, first = [], [], None
    for batch in dl:
        first = first or {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
        shapes.append(tuple(batch["input_ids"].shape))
        loss = deepspeed_sp_compute_loss(None, engine, batch, False, pc)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    probe = _alias_probe(groups, mpu)
    engine.destroy()
    return {
        "losses": losses,
        "len": len(dl),
        "shapes": shapes,
        "first": first,
        "probe": probe,
        "before": before,
        "impl_during": impl_during,
        "impl_after": model.config._attn_implementation,
        "after_destroy": groups._get_sequence_parallel_world_size(),
        "eval_diff": eval_diff,
    }


def _eval_gap(engine: Any) -> float:
    """``disable_in_eval=True``: in eval mode every rank runs the whole (unsplit) row with plain causal attention;
    the largest logit difference from the unregistered model (same weights) on rank 0's first unpadded row."""
    row = loader_batches(0, 2)[0]["input_ids"][:1]
    plain = ulysses_model().eval()
    engine.eval()
    with torch.no_grad():
        got, want = engine(input_ids=row).logits, plain(input_ids=row).logits
    engine.train()
    return float((got - want).abs().max())


def _no_mpu() -> dict[str, Any]:
    return {"get_sequence_parallel_world_size": lambda: 1, "get_sequence_parallel_rank": lambda: 0}


def state_module_run() -> dict[str, Any]:
    """``parallel_state_sp.initialize_sequence_parallel(2)`` then ``initialize(mpu=parallel_state_sp)``: the engine
    switches the model itself; the first loader batch of rank 0 through ``shard_batch`` / ``sp.loss``."""
    from hybridzero.deepspeed_alias import install, uninstall

    assert install()
    try:
        import deepspeed
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from deepspeed.utils import groups

        world = torch.distributed.get_world_size()
        parallel_state_sp.initialize_sequence_parallel(2)
        try:
            parallel_state_sp.initialize_sequence_parallel(2)
            again = ""
        except RuntimeError as exc:
            again = str(exc)
        model = ulysses_model()
        engine, *_ = deepspeed.initialize(model=model, config=ds_config(world, 2, 1), mpu=parallel_state_sp)
        impl = model.config._attn_implementation
        whole = loader_batches(0, world)[0]
        batch = engine.sequence_parallel.shard_batch(whole["input_ids"], whole["labels"], whole["attention_mask"])
        logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = engine.sequence_parallel.loss(logits, batch["shift_labels"]).item()
        sizes = (parallel_state_sp.get_sequence_parallel_world_size(), parallel_state_sp.get_data_parallel_world_size())
        engine.destroy()
        return {
            "again": again,
            "impl": impl,
            "loss": loss,
            "sizes": sizes,
            "after": groups._get_sequence_parallel_rank(),
        }
    finally:
        uninstall()


PACKED_LENGTHS = ((5, 8), (4, 6, 3))  # each row's sequences (13 slots: padded to 14, a sequence crosses slot 7)


def packed_loader_batches(rank: int) -> list[dict[str, torch.Tensor]]:
    """Rank ``rank``'s one packed batch, as ``DataCollatorWithFlattening`` builds rows: sequences concatenated,
    ``position_ids`` restarting at 0, each sequence's first label -100; the sequences as a list too (not a tensor of
    the batch's shape, so the adapter passes it on whole)."""
    gen = torch.Generator().manual_seed(555 + rank)
    ids, positions, labels, seqs = [], [], [], []
    for lengths in PACKED_LENGTHS:
        parts = [torch.randint(3, 113, (n,), generator=gen) for n in lengths]
        seqs.extend(p.tolist() for p in parts)
        ids.append(torch.cat(parts))
        positions.append(torch.cat([torch.arange(n) for n in lengths]))
        labels.append(torch.cat([torch.cat([torch.tensor([-100]), p[1:]]) for p in parts]))
    return [{"input_ids": torch.stack(ids), "position_ids": torch.stack(positions), "labels": torch.stack(labels)}]


def packed_reference(rank: int) -> float:
    """The s = 1 loss of rank ``rank``'s packed batch, unpacked: every sequence forwarded alone by the plain model,
    the per-token mean of all their next-token losses."""
    model = ulysses_model()
    total, count = 0.0, 0
    batch = packed_loader_batches(rank)[0]
    with torch.no_grad():
        for row, lengths in enumerate(PACKED_LENGTHS):
            start = 0
            for n in lengths:
                seq = batch["input_ids"][row, start : start + n][None]
                logits = model(input_ids=seq).logits[0, :-1]
                total += float(torch.nn.functional.cross_entropy(logits, seq[0, 1:], reduction="sum"))
                count += n - 1
                start += n
    return total / count


def ds_named_packed_run() -> dict[str, Any]:
    """s = 2 through DeepSpeed's names with packed loader batches: this rank's losses of the group's two
    micro-batches (rank 0's batch, then rank 1's; one optimizer step after both, so both precede any update)."""
    from hybridzero.deepspeed_alias import install, uninstall

    assert install()
    try:
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
        from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

        deepspeed.init_distributed()
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        model = ulysses_model()
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation="sdpa",
            sequence_parallel_size=2,
            micro_batch_size=MICRO,
            seq_length=None,
            seq_length_is_variable=True,
        )
        engine, *_ = deepspeed.initialize(model=model, config=ds_config(world, 2, 2), mpu=mpu)
        dl = UlyssesSPDataLoaderAdapter(
            packed_loader_batches(rank), rank, mpu.get_sequence_parallel_group(), 2, torch.device("cpu")
        )
        pc = SimpleNamespace(sp_backend="deepspeed", sp_size=2)
        losses = []
        for _ in range(2):
            loss = deepspeed_sp_compute_loss(None, engine, next(dl), False, pc)
            engine.backward(loss)
            losses.append(loss.item())
        engine.step()
        engine.destroy()
        return {"losses": losses}
    finally:
        uninstall()
