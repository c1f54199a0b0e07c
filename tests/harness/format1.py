"""The earlier pickle-based checkpoint format 1, written for tests exactly as its writer laid it out (the writer of
``hybridzero/checkpoint/engine_io.py`` before format 2): ``meta.json``, ``extra.pt`` and ``rank_NNNNN.pt`` files
made with ``torch.save``.

:func:`downgrade` rebuilds a format-1 tag from a format-2 one written by a real engine run, so a test owns an old
checkpoint of known content without the old code: per rank ``{"rank", "groups": {group: {"lo", "hi", "tensors":
{"master", per-element state}}}, "rng": {"torch", "python", "cuda"}}``; ``extra.pt`` holds ``{"scalars":
{param-group index: {key: value.item()}}, "client_state", "param_groups", "scheduler", "loss_scaler"}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hybridzero.checkpoint.format import open_tag


def _rank_payload(saved: Any, rank: int, entry: dict[str, Any]) -> dict[str, Any]:
    rng, header = saved.rank_state(rank)
    groups = {
        g: {
            "lo": part["lo"],
            "hi": part["hi"],
            "tensors": {k: saved.tensor(rank, f"{g}/{k}", 0, part["hi"] - part["lo"]) for k in part["keys"]},
        }
        for g, part in entry.items()
    }
    cuda = [rng[f"rng/cuda/{i}"] for i in range(sum(k.startswith("rng/cuda/") for k in rng))]
    return {
        "rank": rank,
        "groups": groups,
        "rng": {"torch": rng["rng/torch"], "python": header["python_rng"], "cuda": cuda or None},
    }


def _extra(state: dict[str, Any]) -> dict[str, Any]:
    opt = state["optimizer"]
    scalars = {
        int(k): {key: e["value"].item() if isinstance(e["value"], torch.Tensor) else e["value"] for key, e in v.items()}
        for k, v in (opt["state"] if opt is not None else {}).items()
    }
    return {
        "scalars": scalars,
        "client_state": state["client_state"],
        "param_groups": opt["param_groups"] if opt is not None else [],
        "scheduler": state["scheduler"],
        "loss_scaler": state["loss_scaler"],
    }


def downgrade(src_root: Path, tag: str, dst_root: Path) -> Path:
    """Write format-1 tag ``dst_root/tag`` (and ``latest``) holding the content of format-2 ``src_root/tag``."""
    saved = open_tag(src_root / tag)
    meta, state = saved.meta, saved.state()
    out = dst_root / tag
    out.mkdir(parents=True)
    for r, entry in enumerate(meta["ranks"]):
        torch.save(_rank_payload(saved, r, entry), out / f"rank_{r:05d}.pt")
    torch.save(_extra(state), out / "extra.pt")
    keys = ("world_size", "stage", "global_steps", "micro_steps", "skipped_steps", "params", "groups", "optimizer")
    meta1 = {"format": 1, "tag": tag, **{k: meta[k] for k in keys}}
    meta1.update(hf_config=meta["hf_config"], model_class=meta["model_class"])
    (out / "meta.json").write_text(json.dumps(meta1, indent=1))
    (dst_root / "latest").write_text(tag)
    return out
