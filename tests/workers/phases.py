"""Per-rank phase probes for ZeRO-3 engines (module-level functions: picklable for the worker pool).

* :func:`phase_sequence_pair` runs an arbitrary sequence of phases (train step, train-mode ``no_grad`` forward, eval
  forward, ``generate``, submodules called directly, a block called twice in one forward, activation-checkpointed
  train step) twice, prefetch off and prefetch large, asserting quiescence after every phase.
* :func:`event_probe`, :func:`generate_bytes_probe` and :func:`direct_calls_probe` record what the coordinator does
  in one precise situation (event order, all-gathers during generation, directly called submodules).

Every engine here wraps :class:`RepeatBlockOPT` (the tiny 2-block OPT with tied embeddings) with persistence
threshold 0, so the groups are ``root``, ``model.decoder.layers.0`` and ``model.decoder.layers.1``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers

from tests.harness.models import tiny_opt

__all__ = [
    "PHASE_KINDS",
    "Phase",
    "RepeatBlockOPT",
    "direct_calls_probe",
    "event_probe",
    "generate_bytes_probe",
    "phase_data",
    "phase_sequence_pair",
    "phase_sequence_run",
    "repeat_block_opt",
]

Phase = tuple[str, int]
"""``(kind, argument)``: ``("generate", max_new_tokens)``, ``("ckpt", use_reentrant)``, else the argument is 0."""

PHASE_KINDS: tuple[str, ...] = ("train", "nograd", "eval", "generate", "submodule", "twice", "ckpt")
_PAD = 1
LARGE_BUCKET = 10**9


def block_output(out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A decoder block's hidden states: transformers 5 blocks return the tensor, 4.x blocks a tuple led by it."""
    return out[0] if isinstance(out, tuple) else out


class RepeatBlockOPT(transformers.OPTForCausalLM):
    """OPT whose forward, given ``repeat_block=True``, calls decoder block 0 a second time inside the same forward
    (on block 0's own output) and adds ``0.01 · mean(second output²)`` to the loss. Otherwise plain OPT."""

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        repeat_block: bool = False,
        **kwargs: Any,
    ) -> Any:
        """HF's causal-LM output; with ``repeat_block`` its loss includes the second call of block 0."""
        if not repeat_block:
            return super().forward(input_ids=input_ids, labels=labels, **kwargs)
        out = super().forward(input_ids=input_ids, labels=labels, output_hidden_states=True, **kwargs)
        again = block_output(self.model.decoder.layers[0](out.hidden_states[1]))
        extra = again.float().pow(2).mean() * 0.01
        out.loss = extra if out.loss is None else out.loss + extra
        return out


def repeat_block_opt(seed: int = 0) -> RepeatBlockOPT:
    """A :class:`RepeatBlockOPT` with exactly ``tiny_opt(seed)``'s config and weights."""
    base = tiny_opt(seed)
    torch.manual_seed(seed)
    model = RepeatBlockOPT(base.config)
    model.load_state_dict(base.state_dict())
    model.to(torch.float32)
    model.train()
    return model


def _config(
    bucket: int, world_size: int, lr: float = 1e-2, optimizer: str = "AdamW", reuse: int = 1_000_000_000
) -> dict[str, Any]:
    """ZeRO-3, micro-batch 2, no accumulation, nothing persistent, prefetch ``bucket``, no weight decay;
    ``reuse`` is ``stage3_max_reuse_distance`` (0: every group released after its forward)."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2 * world_size,
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": bucket,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": reuse,
        },
        "optimizer": {"type": optimizer, "params": {"lr": lr, "weight_decay": 0.0}},
    }


def _engine(bucket: int, **config: Any) -> Any:
    """A fresh engine over ``repeat_block_opt(0)`` recording its events (``config``: ``_config`` overrides)."""
    import hybridzero

    hybridzero.init_distributed()
    world = torch.distributed.get_world_size()
    engine, *_ = hybridzero.initialize(
        model=repeat_block_opt(0), config=_config(bucket, world, **config), record_events=True
    )
    return engine


def phase_data(index: int, rank: int, batch: int = 2, seq: int = 6) -> torch.Tensor:
    """Token ids ``[batch, seq]`` for phase ``index`` on ``rank`` (private generator; no pad/bos/eos tokens)."""
    generator = torch.Generator().manual_seed(1009 * index + rank)
    return torch.randint(3, 99, (batch, seq), generator=generator, dtype=torch.int64)


# --- the phases -------------------------------------------------------------------------------------------------------
def _train(engine: Any, ids: torch.Tensor, **forward: Any) -> torch.Tensor:
    """Train-mode forward (``forward`` extra kwargs), backward, step; the loss."""
    engine.train()
    loss = engine(input_ids=ids, labels=ids, **forward).loss
    engine.backward(loss)
    engine.step()
    return loss.detach()


def _nograd(engine: Any, ids: torch.Tensor, train: bool) -> torch.Tensor:
    """A ``no_grad`` forward in train or eval mode; the logits (the engine is left in train mode)."""
    engine.train(train)
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    engine.train()
    return logits


def _generate(engine: Any, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy ``engine.module.generate`` (eval mode) from the first 3 tokens; the generated ids."""
    engine.eval()
    prompts = ids[:, :3]
    with torch.no_grad():
        out = engine.module.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=_PAD,
        )
    engine.train()
    return out


def _submodule(engine: Any, ids: torch.Tensor) -> torch.Tensor:
    """Embedding, ``project_in`` and block 1 called directly (outside any root forward), with grad, then a step."""
    decoder = engine.module.model.decoder
    hidden = decoder.project_in(engine.module.get_input_embeddings()(ids))
    loss = block_output(decoder.layers[1](hidden)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.detach()


def _checkpointed(engine: Any, ids: torch.Tensor, reentrant: bool) -> torch.Tensor:
    """A train step with HF activation checkpointing on (reentrant or not), switched off again afterwards."""
    model = engine.module
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    try:
        return _train(engine, ids)
    finally:
        model.gradient_checkpointing_disable()
        model.disable_input_require_grads()


def run_phase(engine: Any, phase: Phase, ids: torch.Tensor) -> torch.Tensor:
    """Run one phase on ``engine``; its output (loss, logits or generated ids)."""
    kind, arg = phase
    runners: dict[str, Callable[[], torch.Tensor]] = {
        "train": lambda: _train(engine, ids),
        "nograd": lambda: _nograd(engine, ids, train=True),
        "eval": lambda: _nograd(engine, ids, train=False),
        "generate": lambda: _generate(engine, ids, arg),
        "submodule": lambda: _submodule(engine, ids),
        "twice": lambda: _train(engine, ids, repeat_block=True),
        "ckpt": lambda: _checkpointed(engine, ids, bool(arg)),
    }
    return runners[kind]()


def phase_sequence_run(phases: Sequence[Phase], bucket: int) -> dict[str, Any]:
    """Run ``phases`` on a fresh engine (``stage3_prefetch_bucket_size=bucket``); quiescent after every phase."""
    engine = _engine(bucket)
    rank = torch.distributed.get_rank()
    outputs = []
    for i, phase in enumerate(phases):
        outputs.append(run_phase(engine, phase, phase_data(i, rank)))
        try:
            engine.assert_quiescent()
        except AssertionError as exc:
            raise AssertionError(f"after phase {i} {phase} of {list(phases)}: {exc}") from exc
    params = engine.full_parameters()  # a collective: every rank calls it
    return {
        "outputs": outputs,
        "params": params if rank == 0 else None,
        "invalidations": engine.prefetcher.invalidations,
        "prefetches": sum(1 for e in engine.events if e[0] == "prefetch"),
    }


def phase_sequence_pair(phases: Sequence[Phase]) -> dict[int, dict[str, Any]]:
    """:func:`phase_sequence_run` with prefetch off (bucket 0) and large (bucket 10⁹), keyed by bucket."""
    return {bucket: phase_sequence_run(phases, bucket) for bucket in (0, LARGE_BUCKET)}


# --- probes -------------------------------------------------------------------------------------------------------
def event_probe(bucket: int, mixed: Sequence[Phase]) -> dict[str, Any]:
    """Events of two train forward/backward/step iterations (reuse distance 0: the classic release-after-forward
    order), then the invalidations over the ``mixed`` phases."""
    engine = _engine(bucket, reuse=0)
    ids = phase_data(0, torch.distributed.get_rank())
    iterations = []
    for _ in range(2):
        engine.events.clear()
        loss = engine(input_ids=ids, labels=ids).loss
        forward = list(engine.events)
        engine.events.clear()
        engine.backward(loss)
        backward = list(engine.events)
        engine.step()
        engine.assert_quiescent()
        iterations.append({"forward": forward, "backward": backward})
    before = engine.prefetcher.invalidations
    for i, phase in enumerate(mixed):
        run_phase(engine, phase, phase_data(i + 1, torch.distributed.get_rank()))
        engine.assert_quiescent()
    return {
        "iterations": iterations,
        "groups": [g.name for g in engine.groups],
        "mixed_invalidations": engine.prefetcher.invalidations - before,
    }


def generate_bytes_probe(new_tokens: int) -> dict[str, Any]:
    """All-gather calls and bytes during one ``generate`` of exactly ``new_tokens`` tokens (same prompts on every
    rank, prefetch off), with the number of root forwards counted by a forward hook."""
    engine = _engine(0)
    forwards = [0]

    def count(module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook on the root: one more model forward."""
        forwards[0] += 1

    handle = engine.module.register_forward_hook(count)
    prompts = phase_data(0, rank=0)[:, :4]
    mark = engine.comm_ledger().copy()
    engine.eval()
    with torch.no_grad():
        out = engine.module.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=_PAD,
        )
    handle.remove()
    window = engine.comm_ledger().since(mark)
    engine.assert_quiescent()
    gathers = window.total(collective="all_gather")
    return {
        "forwards": forwards[0],
        "groups": len(engine.groups),
        "gather_calls": gathers.calls,
        "gather_bytes": gathers.bytes,
        "group_bytes": sum(4 * g.numel for g in engine.groups),
        "other_calls": sum(
            e.calls for k, e in window.items() if k.collective != "all_gather" and k.phase != "generate_sync"
        ),
        "sync_calls": window.total(phase="generate_sync").calls,
        "sync_bytes": window.total(phase="generate_sync").bytes,
        "generated": out,
    }


def direct_calls_probe(lr: float) -> dict[str, Any]:
    """Directly called submodules: the embedding under ``no_grad``, then embedding → ``project_in`` → block 1 with
    grad, backward and one SGD step (per-rank data); quiescent after each. Returns outputs and final parameters."""
    engine = _engine(0, lr=lr, optimizer="SGD")
    rank = torch.distributed.get_rank()
    ids = phase_data(0, rank)
    with torch.no_grad():
        embedded = engine.module.get_input_embeddings()(ids)
    engine.assert_quiescent()
    decoder = engine.module.model.decoder
    loss = block_output(decoder.layers[1](decoder.project_in(engine.module.get_input_embeddings()(ids)))).pow(2).mean()
    engine.backward(loss)
    engine.assert_quiescent()
    engine.step()
    engine.assert_quiescent()
    params = engine.full_parameters()
    return {"embedded": embedded, "loss": loss.detach(), "params": params if rank == 0 else None}


def reuse_after_forward_only_probe(reuse: int) -> dict[str, Any]:
    """Groups still gathered (ZeRO-3 groups not SHARDED) after each root forward of: two train steps, three
    grad-enabled forwards without a backward (``empty_partition_cache()`` after the last), two train steps; with
    ``stage3_max_reuse_distance`` = ``reuse``. Returns the counts, the losses and the final parameters."""
    from hybridzero.zero.groups import GroupState

    engine = _engine(0, reuse=reuse)
    rank = torch.distributed.get_rank()
    kept, losses = [], []

    def forward(i: int) -> torch.Tensor:
        loss = engine(input_ids=phase_data(i, rank), labels=phase_data(i, rank)).loss
        kept.append(sum(1 for g in engine.groups if not g.always_full and g.state is not GroupState.SHARDED))
        losses.append(loss.detach())
        return loss

    for i, train in enumerate((True, True, False, False, False, True, True)):
        loss = forward(i)
        if train:
            engine.backward(loss)
            engine.step()
            engine.assert_quiescent()
        elif i == 4:
            engine.empty_partition_cache()
            engine.assert_quiescent()
    params = engine.full_parameters()
    return {"kept": kept, "losses": losses, "params": params if rank == 0 else None}
