"""What the Hugging Face Trainer and Accelerate tests share: the tiny model on disk, the torchrun launch, the
single-process reference of the same global batch, and the tolerances.

Data order (both scripts, any world): rank ``r`` at step ``t`` trains on rows ``[(t W + r) b, (t W + r + 1) b)`` of the
fixed token rows -- accelerate's batch-sampler sharding of a sequential loader of per-device batch ``b``. The reference
runs each rank's micro-batch in turn, averages the gradients over ranks (the engine's mean reduction), clips the
global norm and steps torch's AdamW (and the same learning-rate schedule).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

REPO = Path(__file__).resolve().parents[2]
STEPS, BATCH, SEQ, LR, WEIGHT_DECAY, CLIP = 4, 2, 9, 1e-2, 0.01, 1.0
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}  # the parity tests' tolerance for values that went through an fp32 update
WEIGHT_TOL = {"rtol": 1e-5, "atol": 1e-6}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDZERO_TIMEOUT_S": "120", "PYTHONPATH": str(REPO)}


def write_tiny_model(path: Path) -> Path:
    """A tiny Llama (numels not divisible by 2, 3 or 4) saved as a Hugging Face directory: the scripts load it."""
    sys.path.insert(0, str(REPO / "examples"))
    import deepspeed_style_train

    deepspeed_style_train.build_model(seed=0).save_pretrained(path)
    return path


def torchrun(script: str, world: int, args: list[str], timeout: int = 600, where: Path = REPO / "examples") -> None:
    """Run ``where/<script>`` (an example by default) under ``torch.distributed.run`` with ``world`` local ranks;
    fail with its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    proc = subprocess.run(
        [*cmd, str(where / script), *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"{script} at world {world} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def records(out: Path, prefix: str, world: int) -> list[dict[str, Any]]:
    """Every rank's JSON record, in rank order."""
    return [json.loads((out / f"{prefix}rank{r}.json").read_text()) for r in range(world)]


def token_rows(n: int, vocab: int) -> torch.Tensor:
    """The scripts' rows (same generator and seed)."""
    return torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(1234))


def reference(
    model_dir: Path, world: int, schedule: Callable[[int], float] | None = None, accumulation: int = 1
) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Per-rank losses of every micro-step and the final weights of one unsharded process on the same global
    batches (with ``accumulation`` micro-steps per step: rank ``r``'s ``m``-th micro-batch of step ``t`` is batch
    ``(t A + m) W + r``, and the step's gradient is the mean over ranks and micro-steps)."""
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    rows = token_rows(STEPS * accumulation * BATCH * world, model.config.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule is not None else None
    named = dict(model.named_parameters())
    losses: list[list[float]] = [[] for _ in range(world)]
    for step in range(STEPS):
        total = {n: torch.zeros_like(p) for n, p in named.items()}
        for m in range(accumulation):
            for r in range(world):
                first = ((step * accumulation + m) * world + r) * BATCH
                ids = rows[first : first + BATCH]
                model.zero_grad(set_to_none=True)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                losses[r].append(loss.item())
                for n, p in named.items():
                    assert p.grad is not None
                    total[n].add_(p.grad)
        for n, p in named.items():
            p.grad = total[n].div_(world * accumulation)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        if sched is not None:
            sched.step()
    return losses, {n: t.detach().clone() for n, t in model.state_dict().items()}


def linear_warmup(step: int) -> float:
    """Trainer's ``lr_scheduler_type="linear"`` with ``warmup_steps=1`` over ``STEPS`` steps."""
    return step / 1.0 if step < 1 else max(0.0, (STEPS - step) / (STEPS - 1))


def assert_same_curve(got: list[float], want: list[float], what: str) -> None:
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), **LOSS_TOL, msg=what
    )


def assert_saved_weights(saved_dir: Path, want: dict[str, torch.Tensor]) -> None:
    """``saved_dir`` (written by ``save_model`` / ``save_pretrained``) loads in a plain process to ``want``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(saved_dir, dtype=torch.float32)
    got = model.state_dict()
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **WEIGHT_TOL, msg=lambda m, n=name: f"{n}: {m}")
