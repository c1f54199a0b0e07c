"""Per-rank bodies for config keys that act in the engine: the gradient-reduction options
(``gradient_allreduce_op``, ``prescale_gradients``, ``gradient_predivide_factor``), ``ignore_unused_parameters`` and
``steps_per_print``."""

from __future__ import annotations

import logging
from typing import Any

import torch

import hybridzero
from hybridzero.runtime.engine import Engine
from tests.harness.parity import RunSpec, batches_for, build_model, ds_config


def full_gradients(engine: Engine) -> dict[str, torch.Tensor]:
    """Every trainable parameter's reduced fp32 gradient in full, gathered from the gradient shards (all ranks)."""
    out: dict[str, torch.Tensor] = {}
    for group in engine.groups:
        layout = group.layout
        if layout.shard_numel == layout.padded_numel:  # a replicated group: the shard is the whole gradient
            flat = group.grad_shard.clone()
        else:
            flat = torch.empty(layout.padded_numel, dtype=torch.float32)
            engine.comm.all_gather(flat, group.grad_shard, phase="consolidate")
        for slot in group.slots:
            if slot.trainable:
                out[slot.spec.name] = flat[slot.spec.offset : slot.spec.end].view(slot.spec.shape).clone()
    return out


def reduction_run(spec: RunSpec, top: dict[str, Any], zero: dict[str, Any], lr: float) -> dict[str, Any]:
    """One micro-batch (``batches[0, 0, rank]``) and one SGD step with the top-level keys ``top`` and the extra
    ``zero_optimization`` keys ``zero``; rank 0 returns the reduced full gradients and the updated parameters."""
    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = build_model(spec)
    cfg = ds_config(spec, world)
    cfg.update({"optimizer": {"type": "SGD", "params": {"lr": lr}}, **top})
    cfg["zero_optimization"].update(zero)
    engine, *_ = hybridzero.initialize(model=model, config=cfg)
    ids = batches_for(spec, world, int(model.config.vocab_size))[0, 0, rank]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    grads = full_gradients(engine)
    engine.step()
    engine.assert_quiescent()
    params = engine.full_parameters()
    return {"grads": grads, "params": params} if rank == 0 else {}


def unused_parameter_run(stage: int, ignore: bool) -> str:
    """A backward from the first block's hidden states (the second block and the final norm get no gradient);
    returns ``"<type>: <error text>"`` of the AssertionError raised (empty when none was raised) after checking the
    engine is quiescent."""
    hybridzero.init_distributed()
    spec = RunSpec(model="llama", stage=stage, steps=1)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = build_model(spec)
    cfg = ds_config(spec, world)
    cfg["zero_optimization"]["ignore_unused_parameters"] = ignore
    engine, *_ = hybridzero.initialize(model=model, config=cfg)
    ids = batches_for(spec, world, int(model.config.vocab_size))[0, 0, rank]
    hidden = engine(input_ids=ids, output_hidden_states=True).hidden_states[1]
    message = ""
    try:
        engine.backward(hidden.pow(2).mean())
    except AssertionError as exc:  # DeepSpeed's type (hybridzero's UnusedParametersError is a RuntimeError too)
        message = f"{type(exc).__name__}: {exc}"
    engine.assert_quiescent()
    return message


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def progress_run(steps_per_print: int, steps: int) -> list[str]:
    """``steps`` optimizer steps; the engine's progress lines (``hybridzero`` logger, INFO) on this rank."""
    hybridzero.init_distributed()
    spec = RunSpec(model="llama", stage=2, steps=steps)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = build_model(spec)
    cfg = {**ds_config(spec, world), "steps_per_print": steps_per_print}
    engine, *_ = hybridzero.initialize(model=model, config=cfg)
    logger, handler = logging.getLogger("hybridzero"), _Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        batches = batches_for(spec, world, int(model.config.vocab_size))
        for s in range(steps):
            ids = batches[s, 0, rank]
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return [line for line in handler.lines if line.startswith("step=")]
