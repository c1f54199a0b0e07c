"""DeepSpeed names with behaviour (issue 31), at world 2 on gloo: ``zero_to_fp32`` on our checkpoints equals
``full_parameters`` bitwise; ``safe_set_full_grad`` / ``safe_set_local_grad`` write the gradient the next step uses;
a ZeRO-3 leaf module (``zero_optimization.leaf_module``) is one gather group and trains bitwise as without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness.parity import RunSpec
from tests.workers.ds_names import (
    ds_model_states,
    fp32_and_grad_setters,
    initialize_inside_init,
    leaf_module_groups,
)

TIMEOUT = 300


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32_and_gradient_setters(world, tmp_path: Path, stage: int) -> None:
    spec = RunSpec(model="llama", stage=stage, steps=3)
    results = world(2).run(fp32_and_grad_setters, spec, str(tmp_path / "ckpt"), timeout=TIMEOUT)
    for r in results:
        assert r["fp32_equal"] and r["full_roundtrip"] and r["zeroed"] and r["unmoved"], r
        assert r["script_executable"], r  # save_checkpoint left DeepSpeed's recovery script, executable
        assert "pytorch_model.bin.index.json" in r["names"] and len(r["names"]) > 2  # sharded at 4000 bytes
    assert results[0]["script_equal"]  # `python SAVE_DIR/zero_to_fp32.py SAVE_DIR OUT` gave the same fp32 weights


def test_leaf_module_is_one_gather_group_and_trains_the_same(world) -> None:
    spec = RunSpec(model="llama", stage=3, steps=2, persistence_threshold=0)
    pool = world(2)
    plain = pool.run(leaf_module_groups, spec, "no_such_module", timeout=TIMEOUT)
    leafy = pool.run(leaf_module_groups, spec, "model", timeout=TIMEOUT)
    assert len(plain[0]["owners"]) > 2 and leafy[0]["owners"] == ["", "model"]  # lm_head root + the leaf
    for p, q in zip(plain, leafy):
        assert p["losses"] == q["losses"]
    for name, t in plain[0]["params"].items():
        assert torch.equal(t, leafy[0]["params"][name]), name


def test_initialize_inside_the_init_block_that_built_the_model(world) -> None:
    """DeepSpeed accepts ``initialize`` inside the ``zero.Init`` block: the context is paused for it, and training
    is bitwise that of ``initialize`` after the block."""
    pool = world(2)
    after = pool.run(initialize_inside_init, False, timeout=TIMEOUT)
    inside = pool.run(initialize_inside_init, True, timeout=TIMEOUT)
    for a, b in zip(after, inside):
        assert a["losses"] == b["losses"]
        for name, t in a["params"].items():
            assert torch.equal(t, b["params"][name]), name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_model_states_file_beside_ours(world, tmp_path: Path, stage: int) -> None:
    """At stages 0-2 a save also holds DeepSpeed's ``mp_rank_00_model_states.pt`` (the whole module's state, as
    DeepSpeed users ``torch.load`` it; frozen parameters left out with ``exclude_frozen_parameters``), loadable with
    ``weights_only=True``; at ZeRO-3 there is none. The directory still resumes as hybridzero's."""
    spec = RunSpec(model="llama", stage=stage, steps=2, frozen=("layers.0.self_attn.q_proj",))
    results = world(2).run(ds_model_states, spec, str(tmp_path / "ckpt"), timeout=TIMEOUT)
    assert all(r["resumed"] for r in results)
    files, keys, frozen = results[0]["files"], results[0]["module_keys"], results[0]["frozen"]
    if stage == 3:
        assert files == {}
        return
    assert frozen and files["all"]["keys"] == keys and files["all"]["equal"] and files["all"]["steps"] == 1
    assert files["trainable"]["keys"] == [k for k in keys if k not in frozen] and files["trainable"]["equal"]
    assert files["trainable"]["size"] < files["all"]["size"]
