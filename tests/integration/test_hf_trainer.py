"""``examples/hf_trainer_zero3.py`` -- a Hugging Face ``Trainer`` script with ``TrainingArguments(deepspeed=cfg)``
whose only addition is ``import hybridzero.as_deepspeed`` -- under torchrun at world 1 and 2, ZeRO-2 and ZeRO-3:

* transformers and accelerate detected "DeepSpeed" (the alias, version ``0.19.8+hybridzero...``), Trainer filled
  the config's ``"auto"`` values, ``is_deepspeed_zero3_enabled()`` held under ZeRO-3 and ``from_pretrained`` built
  the model inside ``deepspeed.zero.Init``; the engine is hybridzero's;
* every rank's loss curve equals a single-process reference of the same global batch (torch AdamW, clipping,
  Trainer's linear warmup schedule) and, at world 2, the curve hybridzero's engine gives directly;
* gradient accumulation 2 (at world 1) goes through Accelerate's ``set_gradient_accumulation_boundary`` and
  Trainer's ``backward(scale_wrt_gas=False)``;
* resuming from the Trainer checkpoint of step 2 (``checkpoint-2/global_step2``) continues the same curve
  (checked at world 2 ZeRO-3 and world 1 ZeRO-2, to keep CI time down);
* ``save_model``'s directory loads with ``from_pretrained`` in a plain process to the reference's final weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import WorldFactory
from tests.integration.hf_common import (
    STEPS,
    assert_same_curve,
    assert_saved_weights,
    linear_warmup,
    records,
    reference,
    torchrun,
    write_tiny_model,
)
from tests.workers.hf_direct import train_direct

SAVE_AT = 2


def _resume(world: int, common: list[str], out: Path, tmp_path: Path) -> list[dict[str, Any]]:
    """Relaunch from ``checkpoint-SAVE_AT`` of ``out``; the resumed run's records."""
    checkpoint = out / "trainer" / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / f"global_step{SAVE_AT}").is_dir()
    assert (checkpoint / "latest").read_text() == f"global_step{SAVE_AT}"  # DeepSpeed's tag name and latest file
    resumed = tmp_path / "resumed"
    torchrun(
        "hf_trainer_zero3.py", world, [*common, "--out", str(resumed), "--resume_from_checkpoint", str(checkpoint)]
    )
    return records(resumed, "resumed_", world)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "stage", "accumulation", "resume"),
    [(2, 3, 1, True), (1, 3, 2, False), (1, 2, 2, True), (2, 2, 1, False)],
)
def test_trainer_script_matches_reference(
    tmp_path: Path, world_size: int, stage: int, accumulation: int, resume: bool, world: WorldFactory
) -> None:
    model_dir = write_tiny_model(tmp_path / "tiny")
    out = tmp_path / "run"
    common = [
        *("--model_dir", str(model_dir), "--stage", str(stage), "--steps", str(STEPS)),
        *("--grad_accum", str(accumulation)),
    ]
    torchrun("hf_trainer_zero3.py", world_size, [*common, "--out", str(out), "--save_steps", str(SAVE_AT)])
    runs = records(out, "run_", world_size)
    resumed = _resume(world_size, common, out, tmp_path) if resume else None

    want, final = reference(model_dir, world_size, linear_warmup, accumulation)
    direct = world(2).run(train_direct, str(model_dir), stage, True, timeout=300) if world_size == 2 else None
    for r, run in enumerate(runs):
        assert run["world"] == world_size and run["global_step"] == STEPS
        assert run["zero3"] is (stage == 3)
        assert run["engine"] == "hybridzero.runtime.engine.Engine"
        assert run["deepspeed_version"].startswith("0.19.8+hybridzero.")
        # Trainer returns the micro-batch loss normalized for accumulation (see RecordingTrainer)
        assert_same_curve(run["losses"], [x / accumulation for x in want[r]], f"rank {r}: Trainer vs reference")
        if resumed is not None:
            assert resumed[r]["global_step"] == STEPS
            assert resumed[r]["losses"] == run["losses"][SAVE_AT * accumulation :], (
                f"rank {r}: the resumed curve differs"
            )
        if direct is not None:
            assert_same_curve(run["losses"], direct[r], f"rank {r}: Trainer vs the engine directly")
    assert_saved_weights(out / "final", final)
