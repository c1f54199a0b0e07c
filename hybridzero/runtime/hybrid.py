"""Hybrid engine: generate on parameters gathered once, with no collective inside the decode loop.

``generation_mode(coordinator)`` (the engine's :class:`ZeroCoordinator`, which holds the module and its groups;
nothing of the engine is needed):

* entry: the engine must be quiescent; every ZeRO-3 group's gather is launched at once (overlapped) and then
  waited; the groups are pinned and the coordinator's hooks bypassed, so the module runs as plain PyTorch / HF code
  with its KV cache. Each rank decodes on its own: different batch sizes, prompt lengths and early EOS across ranks
  cannot hang anything, because nothing is exchanged until exit.
* LoRA (:mod:`hybridzero.lora`): inside full mode every ``LoRALinear`` computes with ``W + s * (R @ L).T``
  written into its gathered buffer (a merged copy for a weight of an always-whole group), its adapter term off;
  on exit the buffers are dropped and copies swapped back, so the shards are untouched.
* exit (normal or exception): hooks back, pins dropped, buffers released; shards were never written, so they are
  bit-exactly what they were, and the memory report returns to its pre-generation value.
* if a gathered-bytes budget says the whole model does not fit, the mode is *bucketed*: hooks stay active and each
  forward gathers group by group (the engine's ordinary ZeRO-3 path with trace prefetch); HF's synced generation
  keeps ranks in step, and every gather is counted in the ledger.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from hybridzero.lora import merged_lora
from hybridzero.zero.coordinator import ZeroCoordinator
from hybridzero.zero.groups import GroupState, ShardedGroup


def gathered_bytes(coordinator: ZeroCoordinator) -> int:
    """Bytes all ZeRO-3 groups take when gathered at once (compute dtype, padding included)."""
    return sum(g.numel * g.compute_dtype.itemsize for g in coordinator.groups if not g.always_full)


def _in_groups(groups: list[ShardedGroup]) -> Callable[[torch.Tensor], bool]:
    """Whether a parameter's bound storage is one of ``groups``' gathered buffers (transient: released on exit, so
    LoRA may merge into it in place; anything else, e.g. a persistent group's master, gets a merged copy)."""
    ids = {id(slot.param) for g in groups for slot in g.slots}
    return lambda p: id(p) in ids


@contextmanager
def _modes_restored(module: nn.Module, to_eval: bool) -> Iterator[None]:
    """Inside: the module in eval mode when ``to_eval``; after: every submodule's own train/eval flag as before."""
    modes = [(m, m.training) for m in module.modules()]
    if to_eval:
        module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@contextmanager
def generation_mode(
    coordinator: ZeroCoordinator, max_gathered_bytes: int | None = None, keep_mode: bool = False
) -> Iterator[str]:
    """Full-parameter generation inside the block; yields ``"full"`` or ``"bucketed"`` (see module docstring).

    The module is in eval mode inside (``keep_mode``: as the caller left it) and every submodule gets its own mode
    back on exit. Re-entrant: inside a full block (the coordinator bypassed, every group pinned whole) a nested block,
    e.g. ``engine.generate`` inside ``unwrap_model_for_generation``, gathers nothing and yields ``"full"``."""
    module = coordinator.module
    if _inside_full_block(coordinator):
        with _modes_restored(module, not keep_mode):
            yield "full"
        return
    coordinator.release_held()
    coordinator.assert_quiescent()
    with _modes_restored(module, not keep_mode):
        if max_gathered_bytes is not None and gathered_bytes(coordinator) > max_gathered_bytes:
            yield "bucketed"
        else:
            with _gathered_whole(coordinator) as mode:
                yield mode


def _inside_full_block(coordinator: ZeroCoordinator) -> bool:
    """True inside a full generation block: hooks bypassed and every ZeRO-3 group pinned whole (tensor-parallel
    generation also bypasses the hooks, with its layers swapped out: that is not this state)."""
    groups = [g for g in coordinator.groups if not g.always_full]
    return coordinator.bypass and all(g.pins > 0 and g.state is GroupState.GATHERED for g in groups)


@contextmanager
def _gathered_whole(coordinator: ZeroCoordinator) -> Iterator[str]:
    """Every ZeRO-3 group gathered and pinned, the hooks bypassed (module docstring); yields ``"full"``."""
    module = coordinator.module
    groups = [g for g in coordinator.groups if not g.always_full]
    synced_flag = getattr(module, "_is_fsdp_managed_module", None)
    for g in groups:
        g.pins += 1  # pinned before any gather: the finally unpins exactly these
    try:
        for g in groups:
            g.start_gather("generate")
        for g in groups:
            g.wait("generate")
        coordinator.bypass = True
        if synced_flag is not None:
            setattr(module, "_is_fsdp_managed_module", False)  # noqa: B010 - nothing to synchronize: HF need not sync
        with merged_lora(module, _in_groups(groups)):  # LoRA: W + s·R@L in the gathered buffers
            yield "full"
    finally:
        if synced_flag is not None:
            module._is_fsdp_managed_module = synced_flag
        coordinator.bypass = False
        for g in groups:
            g.pins -= 1
            coordinator.release(g)


def check_out_tokens(limit: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` if prompt length + ``max_new_tokens`` exceeds ``hybrid_engine.max_out_tokens``. Pure and
    collective-free: the engine checks it before its failure guard, so a too-long request is an ordinary error."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    new = kwargs.get("max_new_tokens")
    if ids is not None and new is not None and ids.shape[-1] + int(new) > limit:
        raise ValueError(
            f"prompt length {ids.shape[-1]} + max_new_tokens {new} exceeds hybrid_engine.max_out_tokens="
            f"{limit}; raise hybrid_engine.max_out_tokens or generate fewer tokens"
        )


def hybrid_generate(
    coordinator: ZeroCoordinator, max_out_tokens: int, *args: Any, max_gathered_bytes: int | None = None, **kwargs: Any
) -> Any:
    """``module.generate`` inside :func:`generation_mode`; checks ``hybrid_engine.max_out_tokens``."""
    check_out_tokens(max_out_tokens, args, kwargs)
    with generation_mode(coordinator, max_gathered_bytes) as mode:
        if mode == "full":
            kwargs.setdefault("synced_gpus", False)  # nothing to synchronize: no collective until exit
        return cast(Any, coordinator.module).generate(*args, **kwargs)  # an HF model's generate
