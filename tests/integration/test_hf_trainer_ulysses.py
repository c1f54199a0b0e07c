"""``examples/hf_trainer_ulysses.py`` -- Hugging Face ``Trainer`` with
``TrainingArguments(parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"), deepspeed=cfg)`` and
``import hybridzero.as_deepspeed`` -- under torchrun at world 2 on CPU (gloo):

* Accelerate's DeepSpeed SP path ran on hybridzero: ``register_with_transformers`` switched the model to hybridzero's
  Ulysses attention, ``initialize(mpu=...)`` built hybridzero's engine, Trainer wrapped its loader in
  ``UlyssesSPDataLoaderAdapter`` (twice the micro-batches) and aggregated the loss over ``deepspeed.utils.groups``'
  SP group;
* its losses equal the ``sp = 1`` run of the same script at world 2 on the same global batches: with s = 2 the SP
  group trains rank 0's then rank 1's loader batch as two micro-batches of one step (accumulation 2), with s = 1
  the two ranks train them side by side (accumulation 1); 3 SGD steps (lr 0.1), rows whose first 5 tokens carry no
  loss (so of a 13-token row's 8 targets, padded to 14 positions, slice 0 holds 3 and slice 1 holds 5: Trainer's
  token-weighted aggregation is exercised with unequal weights).

Tolerance: the parity tests' 1e-5 relative (``LOSS_TOL``): the attention is the same arithmetic (the all-to-alls move
values, SDPA on CPU computes each head alone); the loss and every gradient entry reassociate sums of <= 16 fp32
terms (slice by slice, then over the group): ~n u = 1e-6 relative, carried linearly by SGD over 3 steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.hf_common import assert_same_curve, torchrun
from tests.workers.ulysses_alias import ulysses_model

STEPS = 3


def _run(model_dir: Path, out: Path, sp: int, accumulation: int) -> list[dict[str, object]]:
    args = ["--model_dir", str(model_dir), "--out", str(out), "--sp", str(sp), "--grad_accum", str(accumulation)]
    torchrun("hf_trainer_ulysses.py", 2, [*args, "--steps", str(STEPS)])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_trainer_parallelism_config_sp2_matches_sp1(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny"
    ulysses_model().save_pretrained(model_dir)
    sp2 = _run(model_dir, tmp_path / "sp2", 2, 2)
    sp1 = _run(model_dir, tmp_path / "sp1", 1, 1)
    want = [sp1[rank]["losses"][t] for t in range(STEPS) for rank in range(2)]  # type: ignore[index]
    for rank, run in enumerate(sp2):
        assert run["engine"] == "hybridzero.runtime.engine.Engine" and run["global_step"] == STEPS, run
        assert str(run["attn"]).startswith("hybridzero_ulysses_"), run
        assert_same_curve(run["losses"], want, f"rank {rank}: Trainer sp=2 vs sp=1")  # type: ignore[arg-type]
    assert all(r["attn"] == "sdpa" and r["global_step"] == STEPS for r in sp1), sp1
