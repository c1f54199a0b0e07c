"""What a checkpoint holds and what the engine writes besides it: optimizer state of every shape and dtype survives a
round trip, the 16-bit model file (``save_16bit_model``: bf16 values equal to the gathered parameters, nothing written
without ``stage3_gather_16bit_weights_on_model_save``, a file name that is a path refused), DeepSpeed's load options
(``load_module_only``, ``load_optimizer_states``, ``exclude_frozen_parameters``), and ``from_pretrained`` checking every
shape. The hostile-input cases are in ``test_checkpoint_trust.py``, whose ``SPEC`` this file shares.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridzero.checkpoint.export import export_hf
from tests.distributed.test_checkpoint_trust import SPEC
from tests.harness.models import tiny_llama
from tests.harness.parity import RunSpec
from tests.harness.spawn import RemoteError
from tests.workers.ckpt_trust import (
    deepspeed_load_options,
    from_pretrained_error,
    odd_state_round_trip,
    save_16bit,
)


# --- optimizer state of every shape, and the 16-bit model ------------------------------------------------------
def test_optimizer_state_keeps_shape_and_dtype(world, tmp_path: Path) -> None:
    out = world(2).run(odd_state_round_trip, RunSpec(model="llama", steps=3, optimizer="client"), str(tmp_path))
    for r in out:
        assert r["n_leaves"] > 0 and r["state_equal"] and r["params_equal"], r
        assert r["kinds"] == [
            ("count", "torch.int64", ()),
            ("hist", "torch.float64", (5,)),
            ("step", "torch.float32", (1,)),
        ]


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.safetensors"])
def test_save_16bit_model(world, tmp_path: Path, name: str) -> None:
    spec = RunSpec(model="gpt2_tied", steps=1, dtype="bf16", stage=3, persistence_threshold=100)
    off = world(2).run(save_16bit, spec, str(tmp_path / "off"), name, False)
    assert [r["result"] for r in off] == [False, False] and not (tmp_path / "off").exists()
    on = world(2).run(save_16bit, spec, str(tmp_path / "on"), name, True)
    assert [r["result"] for r in on] == [True, True]
    file = tmp_path / "on" / name
    if name.endswith(".bin"):
        got = torch.load(file, weights_only=True)
    else:
        got = load_file(file)
    expected = on[0]["expected"]
    assert set(expected) <= set(got) and "lm_head.weight" in got
    for k, v in expected.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v), k
    assert sorted(os.listdir(tmp_path / "on")) == [name]


@pytest.mark.parametrize("exclude_frozen", [False, True])
def test_deepspeed_load_options(world, tmp_path: Path, exclude_frozen: bool) -> None:
    """load_module_only loads parameters only (counters and optimizer kept, client state returned);
    load_optimizer_states=False keeps the optimizer; a full load restores everything. With
    exclude_frozen_parameters the frozen parameters are not saved and keep the loading engine's (equal) values."""
    spec = SPEC.replace(frozen=("embed_positions",) if exclude_frozen else ())

    out = world(2).run(deepspeed_load_options, spec, str(tmp_path), exclude_frozen)
    for r in out:
        only, no_opt, full = r["module_only"], r["no_optimizer"], r["full"]
        assert only["path_name"] == "a" and only["client"] == {"epoch": 3} == full["client"]
        assert only["params_loaded"] and only["opt_kept"] and only["sched_kept"] and only["counters"] == (1, 1, 0)
        assert no_opt["params_loaded"] and no_opt["opt_kept"] and no_opt["sched_kept"]
        assert no_opt["counters"] == (2, 2, 0)
        assert full["params_loaded"] and full["opt_loaded"] and not full["sched_kept"] and full["counters"] == (2, 2, 0)
    if exclude_frozen:
        meta = json.loads((tmp_path / "a" / "meta.json").read_text())
        assert meta["excluded"] and all("embed_positions" in n for n in meta["excluded"])
        with pytest.raises(ValueError, match="exclude_frozen_parameters"):  # not a complete model
            export_hf(tmp_path, tmp_path / "out", "a")


def test_save_16bit_model_refuses_a_path_as_file_name(world, tmp_path: Path) -> None:
    spec = RunSpec(model="opt", steps=1, stage=2)
    with pytest.raises(RemoteError, match="save_filename"):
        world(2).run(save_16bit, spec, str(tmp_path / "w"), "../escape.bin", True)
    assert not (tmp_path / "escape.bin").exists()


# --- from_pretrained refuses a file whose shapes do not match the model ---------------------------------------
@pytest.mark.parametrize("damage", ["transposed", "oversized"])
def test_from_pretrained_checks_every_shape(world, tmp_path: Path, damage: str) -> None:
    model = tiny_llama(seed=0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    victim = "model.layers.1.self_attn.o_proj.weight"
    w = state[victim]
    state[victim] = w.t().contiguous() if damage == "transposed" else torch.cat([w, w[:1]])
    if damage == "transposed":
        assert state[victim].shape != w.shape  # the tiny model's dims are not square
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    out = world(1).run(from_pretrained_error, str(tmp_path))[0]
    assert out.startswith("ValueError") and victim in out and "shape" in out, out
