"""``examples/deepspeed_style_train.py`` — a DeepSpeed user's script with ``import hybridzero as deepspeed`` as its
only difference — under ``torch.distributed.run`` at world 1, 2 and 4, against a single-process reference: the
losses of every micro-step and the full gradients (``safe_get_full_grad``) of every optimizer step are equal, and
so are the final fp32 values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import deepspeed_style_train as script  # examples/ is on sys.path (tests/conftest.py)
import pytest
import torch
from torch.utils.data import DistributedSampler

_REPO = Path(__file__).resolve().parents[2]
_SCRIPT = _REPO / "examples" / "deepspeed_style_train.py"
_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDZERO_TIMEOUT_S": "120", "PYTHONPATH": str(_REPO)}
STEPS, SEQ, MICRO, ACCUM, LR = 4, 9, 2, 2, 1e-2
# Parts other slices provide; while missing, the script skips them and says so (and only them).


def ds_config(world: int, stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "train_batch_size": MICRO * ACCUM * world,
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
    }


def reference(world: int) -> dict[str, Any]:
    """The same training in one process: rank r's micro-batches from the same DistributedSampler, gradients of
    ``loss / accumulation`` summed in rank order, divided by the world, accumulated; torch AdamW; the same edit."""
    torch.set_num_threads(1)
    model = script.build_model()
    data = script.TokenData(STEPS * MICRO * ACCUM * world, SEQ)
    order = [
        list(DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0, drop_last=True))
        for r in range(world)
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    named = dict(model.named_parameters())
    losses: list[list[float]] = [[] for _ in range(world)]
    grads = []
    for step in range(STEPS):
        acc = {n: torch.zeros_like(p) for n, p in named.items()}
        for m in range(ACCUM):
            total: dict[str, torch.Tensor] = {}
            for r in range(world):
                i = (step * ACCUM + m) * MICRO
                ids = torch.stack([data[j] for j in order[r][i : i + MICRO]])
                model.zero_grad(set_to_none=True)
                loss = model(input_ids=ids, labels=ids).loss
                (loss / ACCUM).backward()
                losses[r].append(loss.item())
                for n, p in named.items():
                    total[n] = p.grad.clone() if r == 0 else total[n].add_(p.grad)
            for n, value in acc.items():
                value.add_(total[n].div_(world))
        grads.append({n: acc[n].reshape(-1) for n in script.WATCHED})
        for n, p in named.items():
            p.grad = acc[n]
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step + 1 == script.EDIT_AFTER_STEP:
            with torch.no_grad():
                named[script.EDITED].mul_(0.5).add_(0.01)
    return {"losses": losses, "grads": grads, "final": {n: named[n].detach().reshape(-1) for n in script.WATCHED}}


def _run(world: int, stage: int, tmp: Path) -> list[dict[str, Any]]:
    cfg = tmp / "ds_config.json"
    cfg.write_text(json.dumps(ds_config(world, stage)))
    out = tmp / "out"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        str(_SCRIPT),
        "--deepspeed",
        "--deepspeed_config",
        str(cfg),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--seq_len",
        str(SEQ),
    ]
    proc = subprocess.run(argv, cwd=tmp, env=_ENV, capture_output=True, text=True, timeout=480, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    weights = torch.load(out / "model_16bit.bin", map_location="cpu", weights_only=True)
    for name, values in records[0]["final"].items():  # save_16bit_model: the consolidated weights, rank 0 wrote
        torch.testing.assert_close(weights[name].float().reshape(-1), torch.tensor(values), rtol=0, atol=0)
    return records


@pytest.mark.parametrize(
    ("world", "stage"),
    [(1, 3), (2, 3), pytest.param(4, 3, marks=pytest.mark.slow), pytest.param(2, 2, marks=pytest.mark.slow)],
)
def test_deepspeed_style_script_matches_reference(tmp_path: Path, world: int, stage: int) -> None:
    records = _run(world, stage, tmp_path)
    ref = reference(world)
    for r, rec in enumerate(records):
        assert rec["world"] == world and rec["steps"] == STEPS and rec["stage"] == stage
        torch.testing.assert_close(
            torch.tensor(rec["losses"], dtype=torch.float64),
            torch.tensor(ref["losses"][r], dtype=torch.float64),
            rtol=1e-6,
            atol=0,
        )
        assert len(rec["grads"]) == STEPS
        for step, got in enumerate(rec["grads"]):
            for name, values in got.items():
                torch.testing.assert_close(
                    torch.tensor(values),
                    ref["grads"][step][name],
                    rtol=1e-5,
                    atol=1e-7,
                    msg=lambda m, s=step, n=name, k=r: f"rank {k} step {s} {n}: {m}",
                )
        for name, values in rec["final"].items():
            torch.testing.assert_close(torch.tensor(values), ref["final"][name], rtol=1e-5, atol=1e-6)
