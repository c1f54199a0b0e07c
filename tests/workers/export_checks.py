"""Helpers for export tests: a large checkpoint, logits of exported vs reference models, and the export's peak of
live tensor memory measured from the outside (a scan of every tensor alive in the process)."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from tests.harness.models import block_dominated_llama
from tests.harness.parity import RunSpec, build_model, ds_config

_IDS = torch.arange(14).reshape(2, 7) % 90 + 3  # token ids valid for every tiny vocabulary (>= 98)


def save_big_checkpoint(ckpt: str, layers: int) -> dict[str, int]:
    """Per rank: wrap :func:`block_dominated_llama` in a ZeRO-3 engine and save it untrained; parameter count and
    the largest parameter's numel."""
    import hybridzero

    hybridzero.init_distributed()
    model = block_dominated_llama(layers)
    sizes = [p.numel() for p in model.parameters()]
    engine, *_ = hybridzero.initialize(
        model=model, config=ds_config(RunSpec(lr=1e-3), torch.distributed.get_world_size())
    )
    engine.save_checkpoint(ckpt)
    return {"numel": sum(sizes), "largest": max(sizes)}


def reference_model(spec: RunSpec, params: dict[str, torch.Tensor]) -> nn.Module:
    """``build_model(spec)`` holding ``params`` (the engine's consolidated parameters), in eval mode."""
    model = build_model(spec)
    with torch.no_grad():
        for name, value in params.items():
            model.get_parameter(name).copy_(value)
    return model.eval()


def logits(model: nn.Module) -> torch.Tensor:
    """Logits of a fixed batch."""
    with torch.no_grad():
        return model(input_ids=_IDS).logits


def load_exported(out_dir: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """``AutoModelForCausalLM.from_pretrained`` of an export (eager attention, eval) and its loading info."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out_dir), attn_implementation="eager", output_loading_info=True
    )
    return model.eval(), info


def index_of(out_dir: str | Path) -> dict[str, Any]:
    """The safetensors index of a sharded export."""
    return json.loads((Path(out_dir) / "model.safetensors.index.json").read_text())


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value)


def live_storages() -> dict[int, int]:
    """``data_ptr -> nbytes`` of every distinct tensor storage alive in this process."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if type(obj) in (torch.Tensor, nn.Parameter) and not obj.is_meta and obj.numel() > 0:
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, ReferenceError):
            continue
    return seen


def export_peak_bytes(ckpt: str, out: str, max_shard_bytes: int, dtype: str = "fp32") -> dict[str, int]:
    """Run ``export_hf`` and report the largest number of tensor bytes it held at once.

    The measurement scans every live tensor (not the exporter's own bookkeeping) after each parameter read and
    right before each file write, counting storages that did not exist before the export (rank files are read
    slice by slice through safetensors, so they hold no tensors of their own).
    """
    from hybridzero.checkpoint import export
    from hybridzero.checkpoint.format import SavedSource

    before = set(live_storages())
    peak = {"bytes": 0, "samples": 0}
    read_flat, save_file = SavedSource.read_flat, export.save_file

    def sample() -> None:
        held = sum(n for ptr, n in live_storages().items() if ptr not in before)
        peak["bytes"], peak["samples"] = max(peak["bytes"], held), peak["samples"] + 1

    def counted_read(self: SavedSource, name: str, lo: int, hi: int) -> torch.Tensor:
        value = read_flat(self, name, lo, hi)
        sample()
        return value

    def counted_save(tensors: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> None:
        sample()
        save_file(tensors, *args, **kwargs)

    with (
        mock.patch.object(SavedSource, "read_flat", counted_read),
        mock.patch.object(export, "save_file", counted_save),
    ):
        export.export_hf(ckpt, out, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return peak
