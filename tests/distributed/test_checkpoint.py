"""Checkpoints: bit-exact resume, resharding to other world sizes, crash safety, clear errors on bad input."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from hybridzero.checkpoint import list_tags
from tests.harness.parity import RunSpec, reference_run, step_losses
from tests.harness.spawn import RemoteError
from tests.workers.ckpt import load_and_consolidate, run_with_checkpoint, save_then_crash, try_load


def _equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        if isinstance(a[name], dict):
            _equal(a[name], b[name])
        else:
            assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize(("stage", "dtype"), [(3, "fp32"), (3, "bf16"), (2, "fp32"), (1, "bf16")])
def test_resume_is_bitwise_equal_to_uninterrupted(world, tmp_path: Path, stage: int, dtype: str) -> None:
    spec = RunSpec(
        model="gpt2_tied",
        steps=5,
        accumulation=2,
        stage=stage,
        dtype=dtype,
        scheduler=True,
        clipping=0.5,
        optimizer="client",
        persistence_threshold=100,
    )
    pool = world(2)
    full = pool.run(run_with_checkpoint, spec, str(tmp_path), None, False)
    saved = pool.run(run_with_checkpoint, spec, str(tmp_path), 2, False)
    resumed = pool.run(run_with_checkpoint, spec, str(tmp_path), None, True)
    assert (tmp_path / "latest").read_text() == "global_step2"
    for r_full, r_res in zip(full, resumed):
        assert r_res["losses"] == r_full["losses"][2 * spec.accumulation :]
    _equal(resumed[0]["params"], full[0]["params"])
    _equal(resumed[0]["state"], full[0]["state"])
    _equal(saved[0]["params"], full[0]["params"])


@pytest.mark.parametrize("optimizer_type", ["Lion", "Adagrad"])
def test_resume_with_lion_or_adagrad_under_one_cycle(world, tmp_path: Path, optimizer_type: str) -> None:
    """DeepSpeed's other config optimizers keep other state (Lion: a momentum and no step count; Adagrad: a sum and a
    step) and OneCycle rewrites Lion's betas every step: a resume restores all of it, bitwise."""
    spec = RunSpec(model="llama", steps=5, optimizer_type=optimizer_type, scheduler="OneCycle")
    pool = world(2)
    full = pool.run(run_with_checkpoint, spec, str(tmp_path), None, False)
    # saved after one step: OneCycle's beta1 is then 0.9, not the 0.85 a freshly built schedule starts from
    pool.run(run_with_checkpoint, spec, str(tmp_path), 1, False)
    resumed = pool.run(run_with_checkpoint, spec, str(tmp_path), None, True)
    for r_full, r_res in zip(full, resumed):
        assert r_res["losses"] == r_full["losses"][1:]
    _equal(resumed[0]["params"], full[0]["params"])
    _equal(resumed[0]["state"], full[0]["state"])


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 3), (2, 4), (4, 2)])
def test_reshard_on_load(world, tmp_path: Path, save_world: int, load_world: int) -> None:
    spec = RunSpec(model="llama", steps=3, accumulation=1, scheduler=True)
    saved = world(save_world).run(run_with_checkpoint, spec, str(tmp_path), 3, False)
    loaded = world(load_world).run(load_and_consolidate, spec, str(tmp_path))
    _equal(loaded[0]["params"], saved[0]["params"])
    _equal(loaded[0]["state"], saved[0]["state"])
    assert loaded[0]["steps"] == 3
    # training continues at the new world size exactly like a single process continuing from the same state
    more = spec.replace(steps=5)
    continued = world(load_world).run(run_with_checkpoint, more, str(tmp_path), None, True)
    ref = reference_run(more, load_world, {"params": saved[0]["params"], "state": saved[0]["state"], "step": 3})
    assert step_losses([{"losses": [[v] for v in r["losses"]]} for r in continued]) == ref["losses"]
    for name, value in ref["params"].items():
        torch.testing.assert_close(continued[0]["params"][name], value, rtol=1e-6, atol=1e-6)
    # and across stages: a stage-3 checkpoint loads into a stage-2 engine unchanged
    staged = world(load_world).run(load_and_consolidate, spec.replace(stage=2), str(tmp_path))
    _equal(staged[0]["params"], saved[0]["params"])


def test_killed_writer_leaves_previous_latest(world, tmp_path: Path) -> None:
    spec = RunSpec(model="opt", steps=2)
    pool = world(2, env={"HYBRIDZERO_TEST": "crash"})
    with pytest.raises(RemoteError):
        pool.run(save_then_crash, spec, str(tmp_path), timeout=120)
    pool.close()
    assert (tmp_path / "latest").read_text() == "tag1"
    assert list_tags(tmp_path) == ["tag1"]
    assert any(".partial-" in p.name for p in tmp_path.iterdir())  # the torn write is there, and ignored
    assert world(2).run(try_load, spec, str(tmp_path), None) == ["ok", "ok"]


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def test_bad_checkpoints_fail_clearly_and_change_nothing(world, tmp_path: Path) -> None:
    spec = RunSpec(model="opt", steps=1)
    pool = world(2)
    pool.run(run_with_checkpoint, spec, str(tmp_path), 1, False)
    before = _digest(tmp_path)
    assert pool.run(try_load, spec, str(tmp_path), "nope") == ["nothing", "nothing"]  # DeepSpeed: (None, None)
    assert pool.run(try_load, spec, str(tmp_path / "absent"), None) == ["nothing", "nothing"]
    other_model = pool.run(try_load, RunSpec(model="llama"), str(tmp_path), None)
    assert all("CheckpointError" in text and "model.embed_tokens.weight" in text for text in other_model), other_model
    assert _digest(tmp_path) == before
    shard = tmp_path / "global_step1" / "rank_00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    truncated = pool.run(try_load, spec, str(tmp_path), None)
    assert all("rank_00001.safetensors" in t and "checksum mismatch" in t for t in truncated), truncated
    shard.unlink()
    missing = pool.run(try_load, spec, str(tmp_path), None)
    assert all("rank_00001.safetensors" in t and "missing" in t for t in missing), missing


def test_save_inside_accumulation_window_saves_the_window_start(world, tmp_path: Path) -> None:
    """DeepSpeed saves inside an accumulation window: parameters, optimizer state and counters are consistent (the
    window's start), the partially accumulated gradients are not saved; a resumed engine starts the window anew."""
    from tests.workers.ckpt import save_inside_accumulation_window

    out = world(2).run(
        save_inside_accumulation_window, RunSpec(model="opt", accumulation=3, steps=1), str(tmp_path / "c")
    )
    for saved, loaded in out:
        assert saved["micro_steps"] == 4 and loaded["micro_steps"] == 3 and loaded["global_steps"] == 1
        _equal(loaded["params"], saved["params"])
        assert loaded["grad_norm"] == 0.0  # no partial gradient came back
