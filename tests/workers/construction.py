"""Per-rank functions for sharded construction, checkpoint loading and memory accounting tests."""

from __future__ import annotations

import ctypes
import gc
import resource
from typing import Any

import torch

from tests.harness.parity import RunSpec, build_model, ds_config


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process (a measurement independent of the engine)."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if type(obj) in (torch.Tensor, torch.nn.Parameter) and not obj.is_meta and obj.numel() > 0:
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, ReferenceError):
            continue
    return sum(seen.values())


def logits_from_pretrained(path: str, model: str, stage: int) -> float:
    """Max |logits difference| between ``from_pretrained`` into shards and the unsharded model."""
    import hybridzero

    hybridzero.init_distributed()
    cfg = ds_config(RunSpec(stage=stage), torch.distributed.get_world_size())
    engine, *_ = hybridzero.from_pretrained(path, cfg, config_overrides={"attn_implementation": "eager"})
    engine.eval()
    ids = torch.arange(14).reshape(2, 7) % 90 + 3
    with torch.no_grad():
        got = engine(input_ids=ids).logits
        want = build_model(RunSpec(model=model)).eval()(input_ids=ids).logits
    engine.assert_quiescent()
    return float((got - want).abs().max())


def big_llama_on_meta(layers: int) -> torch.nn.Module:
    """:func:`tests.harness.models.block_dominated_llama`, built on meta."""
    from tests.harness.models import block_dominated_llama

    with torch.device("meta"):
        return block_dominated_llama(layers)


def _large_allocations_return_to_os() -> None:
    """glibc: serve allocations >= 1 MiB with mmap and never raise that threshold, so a freed buffer leaves the
    process at once and RSS measures live memory rather than what the allocator keeps cached."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def train_meta_model(layers: int, dtype: str = "fp32", live_fraction: float | None = None) -> dict[str, Any]:
    """Build on meta, materialize group by group, train 2 steps; report RSS growth and the engine's accounting."""
    import hybridzero

    _large_allocations_return_to_os()
    hybridzero.init_distributed()
    world = torch.distributed.get_world_size()
    model = big_llama_on_meta(layers)
    numel = sum(p.numel() for p in model.parameters())
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    live0 = live_tensor_bytes()
    live = {} if live_fraction is None else {"stage3_max_live_parameters": int(live_fraction * numel)}
    spec = RunSpec(model="llama", dtype=dtype, lr=1e-3, extra_zero=live)
    engine, *_ = hybridzero.initialize(model=model, config=ds_config(spec, world))
    rss_init = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    losses = []
    for _ in range(2):
        ids = torch.randint(0, 101, (2, 16))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.assert_quiescent()
    return {
        "numel": numel,
        "rss_init_growth": rss_init,
        "losses": losses,
        "report": engine.memory_report(),
        "live_growth": live_tensor_bytes() - live0,
        "peak_gathered": engine.coordinator.peak_gathered_bytes,
    }


def second_engine_over_a_held_model(stage: int, second_stage: int | None = None) -> dict[str, Any]:
    """Engine A trains two steps; engine B is built over the same model while A is alive (DeepSpeed's checkpoint
    tests do this). At ZeRO-3 A holds the parameters as size-0 placeholders, so B reads each one through A's gather.
    Returns which of B's starting parameters differ from A's, whether B then trains, and who owns the parameters.
    ``second_stage``: B's stage, with the attention weights frozen before B (as applying LoRA does), so B groups the
    parameters differently from A."""
    import hybridzero
    from hybridzero.zero.registry import REGISTRY

    hybridzero.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    spec = RunSpec(model="llama", stage=stage, persistence_threshold=0)
    model = build_model(spec)
    first, *_ = hybridzero.initialize(model=model, config=ds_config(spec, world))
    ids = torch.arange(3, 3 + 2 * 9).reshape(2, 9) * (rank + 1) % 90
    for _ in range(2):
        first.backward(first(input_ids=ids, labels=ids).loss)
        first.step()
    want = first.full_parameters()
    if second_stage is not None:
        spec = spec.replace(stage=second_stage)
        for name, p in model.named_parameters():
            p.requires_grad_("self_attn" not in name)
    second, *_ = hybridzero.initialize(model=model, config=ds_config(spec, world))
    got = second.full_parameters()
    loss = second(input_ids=ids, labels=ids).loss
    second.backward(loss)
    second.step()
    return {
        "mismatched": [n for n in want if not torch.equal(want[n], got[n])],
        "trains": bool(torch.isfinite(loss)),
        "owner_is_second": all(REGISTRY.owner_of(p) is second.param_owner for p in model.parameters()),
    }


def engine_over_a_submodule_of_a_held_model() -> str:
    """``initialize`` over a submodule of a model a live ZeRO-3 engine drives: every rank gets the refusal (a failed
    ``initialize`` is a failure of the job: the process group is torn down, as for any error inside it)."""
    import hybridzero

    hybridzero.init_distributed()
    world = torch.distributed.get_world_size()
    spec = RunSpec(model="llama", stage=3, persistence_threshold=0)
    model = build_model(spec)
    hybridzero.initialize(model=model, config=ds_config(spec, world))
    try:
        hybridzero.initialize(model=model.model.layers[0], config=ds_config(spec, world))
    except Exception as exc:  # noqa: BLE001 - the raising rank's ValueError, or a peer's PeerFailure naming it
        return f"{type(exc).__name__}: {exc}"
    return ""
