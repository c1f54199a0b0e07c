"""ZeRO-Offload / ZeRO-Infinity: offload on (CPU or NVMe swap files) is bitwise the run with offload off, at world
1, 2 and 4 and stages 1-3, with accumulation, clipping, bf16 and fp16 overflow skips; the state lives where the
memory report says (checked against live tensors and the swap file); checkpoints cross between offload and none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness.parity import RunSpec
from tests.workers.dropin import set_state_roundtrip
from tests.workers.offload import (
    VARIANTS,
    edit_and_train,
    offload_block,
    save_resume,
    start_with_bad_nvme_path,
    train_variants,
)
from tests.workers.rlhf_runs import make_model_dirs, step3_run

TIMEOUT = 400
_ITEMSIZE = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}

SPECS = {
    "s3_fp32_accum_clip": RunSpec(
        model="gpt2_tied", stage=3, accumulation=2, clipping=0.3, steps=3, persistence_threshold=100, optimizer="client"
    ),
    "s2_bf16_sched": RunSpec(model="llama", stage=2, dtype="bf16", scheduler=True, steps=3),
    "s1_fp16_overflow": RunSpec(
        model="opt",
        stage=1,
        dtype="fp16",
        steps=4,
        inf_at=((1, 0),),
        fp16={"initial_scale_power": 8, "hysteresis": 1},
        clipping=0.5,
    ),
    "s3_bf16_frozen": RunSpec(model="opt", stage=3, dtype="bf16", accumulation=2, frozen=("embed_positions",)),
    # prefetch on: from step 2 the traced gathers are coalesced, reading kept compute shards (masters in files)
    "s3_bf16_prefetch": RunSpec(model="llama", stage=3, dtype="bf16", steps=3, prefetch_bucket_size=10**8),
}
FAST = ("s3_fp32_accum_clip", "s1_fp16_overflow", "s3_bf16_prefetch")


def _equal(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert set(a) == set(b), what
    for name in a:
        if isinstance(a[name], dict):
            _equal(a[name], b[name], f"{what}.{name}")
        else:
            assert torch.equal(a[name], b[name]), f"{what}.{name}: max diff {(a[name] - b[name]).abs().max()}"


def _check_bitwise(results: list[dict[str, Any]]) -> None:
    for rank_result in results:
        base = rank_result["none"]
        for variant in VARIANTS[1:]:
            got = rank_result[variant]
            assert got["losses"] == base["losses"], variant
            assert got["scales"] == base["scales"], variant
            assert got["skipped"] == base["skipped"], variant
    for variant in VARIANTS[1:]:
        _equal(results[0][variant]["params"], results[0]["none"]["params"], f"{variant} params")
        _equal(results[0][variant]["state"], results[0]["none"]["state"], f"{variant} optimizer state")


def _check_placement(results: list[dict[str, Any]], world_size: int) -> None:
    """12 bytes per trainable element on the host (master 4 + Adam 8) / N, the rest where the report says."""
    for r in results:
        none, cpu, nvme = (r[v]["facts"] for v in VARIANTS)
        assert all(f["on_host"] for f in (none, cpu, nvme))
        rep = cpu["report"]["placement"]
        assert rep["host"]["master_weights"] == cpu["master_bytes"] == 4 * cpu["shard_numel"]
        assert rep["host"]["optimizer_state"] == cpu["state_bytes"] == 8 * cpu["leaf_numel"]
        assert rep["host"]["gradients"] > 0 and "master_weights" not in rep["device"]
        assert "optimizer_state" not in rep["device"] and rep["file"] == {}
        # without offload the same bytes are device bytes; the device total drops by exactly what moved
        moved = sum(rep["host"].values())
        dev_none = sum(none["report"]["placement"]["device"].values())
        assert sum(rep["device"].values()) == dev_none - moved and none["report"]["placement"]["host"] == {}
        # NVMe: Adam's state is in the swap file (counted on disk), nothing of it resident between steps
        rep = nvme["report"]["placement"]
        assert rep["file"]["optimizer_state"] == nvme["file_bytes"] == 8 * nvme["leaf_numel"]
        assert nvme["state_bytes"] == 0 and rep["host"]["optimizer_state"] == 0
        # ... and so are the sharded groups' fp32 masters; only the small whole (persistent) ones stay in memory
        assert rep["file"]["master_weights"] == nvme["file_sizes"]["master.bin"] == 4 * nvme["sharded_numel"] > 0
        whole = nvme["shard_numel"] - nvme["sharded_numel"]
        assert rep["host"]["master_weights"] == nvme["master_bytes"] == 4 * whole
        # the kept compute-dtype shard stands in for the master, on the device (no offload_param)
        kept = rep["device"]["parameters"] - none["report"]["placement"]["device"]["parameters"]
        assert kept == nvme["kept_bytes"] == nvme["sharded_numel"] * _ITEMSIZE[nvme["kept_dtype"]]
        assert nvme["files"] == ["master.bin", "optimizer_state.bin"] and nvme["swap_dir_removed"]
    # the optimizer's elements are split over the ranks: each holds ~1/N of them (12 bytes each on the host)
    per_rank = [r["cpu"]["facts"]["leaf_numel"] for r in results]
    assert max(per_rank) - min(per_rank) <= sum(per_rank) // (2 * world_size) + 64 * 20


MATRIX = [
    pytest.param(w, c, marks=() if (w == 2 and c in FAST) else pytest.mark.slow)
    for w in (1, 2, 4)
    for c in sorted(SPECS)
]


@pytest.mark.parametrize(("world_size", "case"), MATRIX)
def test_offload_is_bitwise_identical(world, tmp_path: Path, world_size: int, case: str) -> None:
    results = world(world_size).run(train_variants, SPECS[case], str(tmp_path), timeout=TIMEOUT)
    _check_bitwise(results)
    _check_placement(results, world_size)
    assert not any((tmp_path / "hybridzero-swap").iterdir()), "swap directories left behind"


PARAM_SPECS = {
    "bf16_accum_clip": RunSpec(model="llama", stage=3, accumulation=2, clipping=0.5, dtype="bf16", steps=2),
    "fp16_overflow": RunSpec(
        model="opt",
        stage=3,
        dtype="fp16",
        steps=3,
        inf_at=((1, 0),),
        fp16={"initial_scale_power": 8, "hysteresis": 1},
        persistence_threshold=100,
    ),
    "bf16_prefetch": RunSpec(model="llama", stage=3, dtype="bf16", steps=3, prefetch_bucket_size=10**8),
}
PARAM_MATRIX = [
    pytest.param(w, c, marks=() if (w, c) in ((2, "bf16_accum_clip"), (2, "bf16_prefetch")) else pytest.mark.slow)
    for w in (1, 2, 4)
    for c in sorted(PARAM_SPECS)
]


@pytest.mark.parametrize(("world_size", "case"), PARAM_MATRIX)
def test_offload_param_at_stage_3_is_bitwise_identical(world, tmp_path: Path, world_size: int, case: str) -> None:
    """``offload_param`` cpu and nvme (compute shards in ``params.bin``, read in for each gather, read ahead along
    the learned order) are bitwise the run without offload; nothing of the parameters stays in memory with nvme."""
    results = world(world_size).run(
        train_variants, PARAM_SPECS[case], str(tmp_path), ("none", "cpu", "nvme"), True, timeout=TIMEOUT
    )
    _check_bitwise(results)
    for r in results:
        nvme = r["nvme"]["facts"]
        rep = nvme["report"]["placement"]
        assert nvme["files"] == ["master.bin", "optimizer_state.bin", "params.bin"]
        assert rep["file"]["parameters"] == nvme["file_sizes"]["params.bin"] > 0
        assert rep["file"]["master_weights"] == nvme["file_sizes"]["master.bin"] == 4 * nvme["sharded_numel"]
        assert nvme["kept_bytes"] == 0 and "parameters" not in rep["host"]  # no compute shard kept in memory
        read, written = r["nvme"]["io"]
        assert read > 0 and written > 0
    assert not any((tmp_path / "hybridzero-swap").iterdir()), "swap directories left behind"


@pytest.mark.parametrize("stage", [2, 3])
def test_gathered_parameters_and_fragment_writes_reach_the_files(world, tmp_path: Path, stage: int) -> None:
    """A ``GatheredParameters`` edit with a modifier rank and a ``safe_set_full_fp32_param`` write land in the
    master file and in the compute shards (kept, or in their own file; stage 2 all-gathers them back into the whole
    parameters): training continues bitwise as without offload."""
    spec = RunSpec(model="llama", stage=stage, dtype="bf16", steps=3, edit=("model.layers.0.mlp.up_proj.weight",))
    variants = ("none", "nvme", "nvme+param") if stage == 3 else ("none", "nvme")
    results = world(2).run(edit_and_train, spec, str(tmp_path), variants, timeout=TIMEOUT)
    for r in results:
        for variant in variants[1:]:
            assert r[variant]["losses"] == r["none"]["losses"], variant
    for variant in variants[1:]:
        _equal(results[0][variant]["params"], results[0]["none"]["params"], f"{variant} params")


@pytest.mark.parametrize(
    ("save_with", "load_with"),
    [("nvme", "none"), ("none", "nvme"), ("cpu", "nvme"), ("nvme+param", "none"), ("none", "nvme+param")],
)
def test_checkpoint_crosses_offload_settings(world, tmp_path: Path, save_with: str, load_with: str) -> None:
    spec = RunSpec(model="gpt2_tied", stage=3, steps=4, scheduler=True, clipping=0.5, persistence_threshold=100)
    pool = world(2)
    plain = pool.run(train_variants, spec, str(tmp_path / "nv0"), ("none",), timeout=TIMEOUT)
    resumed = pool.run(
        save_resume, spec, str(tmp_path / "ckpt"), str(tmp_path / "nv1"), save_with, load_with, 3, timeout=TIMEOUT
    )  # saved after step 3: the linear warmup's learning rate is 0 in steps 1 and 2, so the weights moved by then
    for p, r in zip(plain, resumed):
        assert r["losses"] == p["none"]["losses"][3:]
    _equal(resumed[0]["params"], plain[0]["none"]["params"], "params")
    _equal(resumed[0]["state"], plain[0]["none"]["state"], "optimizer state")
    assert not any((tmp_path / "nv1" / "hybridzero-swap").iterdir())


def test_fragment_api_reads_and_writes_swapped_state(world, tmp_path: Path) -> None:
    """``utils.safe_get/set_*_optimizer_state`` see the NVMe-swapped state (through optimizer_state_resident)."""
    spec = RunSpec(model="llama", stage=3, steps=1, extra_zero=offload_block("nvme", str(tmp_path)))
    expected = {"full": True, "local": True, "fp32": True, "key_error": True}
    assert world(2).run(set_state_roundtrip, spec, timeout=TIMEOUT) == [expected, expected]


def test_rlhf_step3_offload_flags_at_world_2(world, tmp_path: Path) -> None:
    """DeepSpeed-Chat's ``--offload --offload_reference_model --offload_reward_model`` (actor/critic optimizer and
    parameters, frozen models' shards on the host) give the same step-3 run as without them, bitwise."""
    actor, value = make_model_dirs(tmp_path / "models")
    base = {
        "actor_model_name_or_path": actor,
        "critic_model_name_or_path": value,
        "per_device_generation_batch_size": 4,
        "per_device_training_batch_size": 2,
        "max_prompt_seq_len": 8,
        "max_answer_seq_len": 6,
        "actor_learning_rate": 3e-3,
        "critic_learning_rate": 3e-3,
        "num_warmup_steps": 0,
        "max_steps": 2,
        "progress": False,
        "enable_tensorboard": False,
        "print_every": 1000,
        "resume": False,
        "seed": 5,
        "enable_ema": True,
        "critic_zero_stage": 2,
        "reward_zero_stage": 3,
        "reference_zero_stage": 3,
    }
    flags = {"offload": True, "offload_reference_model": True, "offload_reward_model": True}
    pool = world(2)
    plain = pool.run(step3_run, {**base, "output_dir": str(tmp_path / "plain")}, timeout=TIMEOUT)[0]
    offloaded = pool.run(step3_run, {**base, **flags, "output_dir": str(tmp_path / "off")}, timeout=TIMEOUT)[0]
    assert len(plain["history"]) == len(offloaded["history"]) == 2
    for got, want in zip(offloaded["history"], plain["history"]):
        for key in ("reward", "kl", "answer_len", "value", "actor_loss", "critic_loss"):
            assert got[key] == want[key], key


def test_unwritable_nvme_path_fails_at_engine_start(world, tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    got = world(1).run(
        start_with_bad_nvme_path, RunSpec(model="llama", stage=2), str(blocker / "swap"), timeout=TIMEOUT
    )[0]
    assert got.startswith("SwapSpaceError: offload_optimizer.nvme_path = ") and "is not a writable directory" in got


def test_offload_param_without_offload_optimizer_is_bitwise_identical(world, tmp_path: Path) -> None:
    """``offload_param: cpu`` alone (DeepSpeed accepts it): the ZeRO-3 compute shards live on the CPU as copies
    re-cast from the master after every step, the master and the optimizer state stay on the device, and training is
    bitwise the run without offload (bf16, accumulation, clipping)."""
    spec = RunSpec(model="llama", stage=3, accumulation=2, clipping=0.5, dtype="bf16", steps=2)
    results = world(2).run(train_variants, spec, str(tmp_path), ("none", "param_only"), timeout=TIMEOUT)
    for r in results:
        got, base = r["param_only"], r["none"]
        assert got["losses"] == base["losses"] and got["scales"] == base["scales"]
        facts = got["facts"]
        assert facts["kept_bytes"] > 0 and facts["kept_dtype"] == "torch.bfloat16"  # compute shards kept (host)
        assert base["facts"]["kept_bytes"] == 0
    _equal(results[0]["param_only"]["params"], results[0]["none"]["params"], "params")
    _equal(results[0]["param_only"]["state"], results[0]["none"]["state"], "optimizer state")
