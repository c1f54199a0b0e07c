"""``examples/accelerate_zero3.py`` -- Accelerate's documented DeepSpeed loop (``DeepSpeedPlugin``,
``accelerator.prepare``, ``accelerator.backward``, ``get_state_dict``) whose only addition is
``import hybridzero.as_deepspeed`` -- under torchrun at world 1 and 2, ZeRO-2 and ZeRO-3:

* accelerate ran its DeepSpeed path on hybridzero's engine, with ``zero.Init`` construction under ZeRO-3;
* every rank's loss curve equals a single-process reference of the same global batch (torch AdamW, clipping) and,
  at world 2, the curve hybridzero's engine gives directly;
* the weights from ``accelerator.get_state_dict`` (saved with ``save_pretrained``) load in a plain process to the
  reference's final weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import WorldFactory
from tests.integration.hf_common import (
    STEPS,
    assert_same_curve,
    assert_saved_weights,
    records,
    reference,
    torchrun,
    write_tiny_model,
)
from tests.workers.hf_direct import train_direct


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "stage"), [(2, 3), (1, 3), (1, 2), (2, 2)])
def test_accelerate_script_matches_reference(tmp_path: Path, world_size: int, stage: int, world: WorldFactory) -> None:
    model_dir = write_tiny_model(tmp_path / "tiny")
    out = tmp_path / "run"
    args = ["--model_dir", str(model_dir), "--stage", str(stage), "--steps", str(STEPS), "--out", str(out)]
    torchrun("accelerate_zero3.py", world_size, args)
    want, final = reference(model_dir, world_size)
    direct = world(2).run(train_direct, str(model_dir), stage, False, timeout=300) if world_size == 2 else None
    for r, run in enumerate(records(out, "", world_size)):
        assert run["world"] == world_size and len(run["losses"]) == STEPS
        assert run["zero3"] is (stage == 3)
        assert run["engine"] == "hybridzero.runtime.engine.Engine"
        assert_same_curve(run["losses"], want[r], f"rank {r}: Accelerate vs reference")
        if direct is not None:
            assert_same_curve(run["losses"], direct[r], f"rank {r}: Accelerate vs the engine directly")
    assert_saved_weights(out / "final", final)
