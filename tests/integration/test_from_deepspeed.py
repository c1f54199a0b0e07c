"""DeepSpeed checkpoints in (``hybridzero convert-checkpoint --from deepspeed``): the fixtures under
``tests/fixtures/deepspeed_0.19.8`` were written by DeepSpeed 0.19.8 itself (``scripts/make_deepspeed_fixtures.py``:
world 2, N = 3 steps, save, M = 3 more). Converted, they carry DeepSpeed's exact Adam moments, step, scheduler and
counters, and resuming on hybridzero at world 1, 2 and 4 (and at another ZeRO stage) follows DeepSpeed's own last M
steps. Crafted files never run code and are refused naming the global they need.

Tolerances. fp32: the parity bound of our DeepSpeed comparison (bench/bench_peers.py), 1e-4 on the loss (~4.5, so
2e-5 relative: rounding of reductions in another order is ~1e-7 relative per step, far below it; measured <= 1e-6)
and 1e-5 on the weights (|w| < 1, Adam moves each element by <= lr = 0.02 a step; measured <= 1.2e-7). bf16: the
forward runs in bf16 (unit roundoff 2^-8) on both sides, with different kernels' rounding, so the loss is bounded by
2e-3 (about half a bf16 ulp at 4.5; measured 7e-5) and the weights by 1e-2 (half of one Adam step's largest move,
lr = 0.02; measured 9e-4).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridzero.checkpoint import CheckpointError
from hybridzero.checkpoint.ds_files import optim_states_file, refuse_deepspeed_dir
from hybridzero.checkpoint.format import SavedSource, open_tag
from hybridzero.checkpoint.from_deepspeed import convert_deepspeed, scaler_state
from hybridzero.cli import main
from tests.workers.from_deepspeed import resume

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_0.19.8"
CASES = ("zero1_fp32", "zero2_fp32", "zero3_fp32", "zero2_bf16")


def _record(case: str) -> dict:
    return json.loads((FIXTURES / case / "record.json").read_text())


@pytest.mark.parametrize("case", CASES)
def test_conversion_carries_deepspeed_state_exactly(case: str, tmp_path: Path) -> None:
    record = _record(case)
    out = convert_deepspeed(FIXTURES / case / "ckpt", tmp_path / "out")
    assert (tmp_path / "out" / "latest").read_text().strip() == "global_step3" == out.name
    tag = open_tag(out)
    state = tag.state()
    assert tag.meta["global_steps"] == record["n_steps"] and tag.meta["micro_steps"] == record["n_steps"]
    assert tag.meta["converted_from"]["global_samples"] == record["n_steps"] * 4
    assert tag.meta["converted_from"]["stage"] == int(case[4]) and tag.meta["converted_from"]["world_size"] == 2
    assert state["scheduler"]["last_batch_iteration"] == record["n_steps"] - 1
    assert state["scheduler"]["_last_lr"] == [record["lr"][record["n_steps"] - 1]]
    assert float(state["optimizer"]["state"]["0"]["step"]["value"]) == record["n_steps"]
    assert state["optimizer"]["class"] == "AdamW" and state["optimizer"]["param_groups"][0]["betas"] == [0.9, 0.95]
    saved = load_file(str(FIXTURES / case / "record.safetensors"))
    probe = record["probe"]
    for key in ("exp_avg", "exp_avg_sq"):
        want = saved[f"saved/{key}/{probe}"].flatten()
        got = SavedSource(tag, key).read_flat(probe, 0, want.numel())
        assert torch.equal(got, want), key
    hf_names = {k.removeprefix("final/") for k in saved if k.startswith("final/")}
    assert set(tag.meta["params"]) == hf_names


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_follows_deepspeed_curve(world, tmp_path: Path) -> None:
    runs = [("zero1_fp32", 1, None), ("zero3_fp32", 2, None), ("zero2_fp32", 4, 3), ("zero2_bf16", 2, None)]
    for case, w, stage in runs:
        record = _record(case)
        out = tmp_path / case
        assert main(["convert-checkpoint", "--from", "deepspeed", str(FIXTURES / case / "ckpt"), str(out)]) == 0
        res = world(w).run(resume, str(FIXTURES / case), str(out), stage, timeout=300)
        n, m = record["n_steps"], record["m_steps"]
        carried = res[0]["carried"]
        assert carried["global_steps"] == n and carried["global_samples"] == 4 * n and carried["step"] == n
        assert carried["last_batch_iteration"] == n - 1 and carried["lr"] == record["lr"][n - 1]
        assert carried["moments"] == ["exp_avg", "exp_avg_sq"]
        assert res[0]["lr"] == record["lr"][n:]
        bf16 = case.endswith("bf16")
        loss_tol, weight_tol = (2e-3, 1e-2) if bf16 else (1e-4, 1e-5)
        ds = [sum(r[s] for r in record["losses"]) / len(record["losses"]) for s in range(n, n + m)]
        ours = [sum(r["losses"][i] for r in res) / w for i in range(m)]
        assert max(abs(a - b) for a, b in zip(ds, ours)) <= loss_tol, (case, ds, ours)
        assert ours[-1] < ours[0] - 0.1  # it trains: the curve is not flat
        final = load_file(str(FIXTURES / case / "record.safetensors"))
        for name, want in ((k.removeprefix("final/"), v) for k, v in final.items() if k.startswith("final/")):
            assert (res[0]["params"][name] - want).abs().max().item() <= weight_tol, (case, name)


def _copy(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / "ds"
    shutil.copytree(FIXTURES / case / "ckpt", dst)
    return dst


class Evil:
    """Any class outside the allowed names."""

    def __init__(self) -> None:
        self.x = 1


def test_file_needing_another_global_is_refused_naming_it(tmp_path: Path) -> None:
    ds = _copy("zero2_fp32", tmp_path)
    target = ds / "global_step3" / optim_states_file(1, False)
    torch.save({"optimizer_state_dict": {"loss_scaler": Evil()}}, target)
    with pytest.raises(CheckpointError, match=r"needs the global 'tests\.integration\.test_from_deepspeed\.Evil'"):
        convert_deepspeed(ds, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_symlinks_and_bad_latest_are_refused(tmp_path: Path) -> None:
    ds = _copy("zero3_fp32", tmp_path)
    name = optim_states_file(0, False)
    moved = tmp_path / "elsewhere.pt"
    (ds / "global_step3" / name).rename(moved)
    (ds / "global_step3" / name).symlink_to(moved)
    with pytest.raises(CheckpointError, match="symbolic links are refused"):
        convert_deepspeed(ds, tmp_path / "out")
    (ds / "latest").write_text("../escape")
    with pytest.raises(CheckpointError, match="tag"):
        convert_deepspeed(ds, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_loading_a_deepspeed_dir_says_how_to_convert(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="convert-checkpoint --from deepspeed .* NEW_DIR"):
        refuse_deepspeed_dir(FIXTURES / "zero1_fp32" / "ckpt", None)
    refuse_deepspeed_dir(tmp_path, None)  # anything else is left to the loader


def test_fp16_loss_scaler_state_maps_to_ours() -> None:
    ds = {"cur_scale": 1024.0, "cur_iter": 10, "last_overflow_iter": 6, "cur_hysteresis": 1, "dynamic": True}
    assert scaler_state(ds, {"fp16": {"enabled": True}}) == {
        "scale": 1024.0,
        "hysteresis_left": 1,
        "good_steps": 3,
        "step": 10,
    }
    assert scaler_state({"cur_scale": 1.0, "dynamic": False}, {}) == {
        "scale": 1.0,
        "hysteresis_left": 2,
        "good_steps": 0,
        "step": 0,
    }
