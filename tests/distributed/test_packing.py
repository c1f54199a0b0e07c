"""Packed = padded training through ZeRO-3 engines at world 1, 2 and 4 (Llama, OPT and GPT-2 shapes, sdpa, fp32).

Each rank trains on its own data; the engine averages gradients over ranks, so a packed forward on any rank that
differed from its padded one would show in every rank's full gradients. Tolerance: see
``tests/unit/test_packing.py`` (fp32, reduction order only): ``rtol = atol = 2e-5``; gradients are additionally
averaged over ranks (one more reduction of at most 4 terms).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.workers.packing import MODEL_NAMES, packing_parity_run

TOL = 2e-5


def _close(pair: tuple[torch.Tensor | float, ...], what: str) -> None:
    a, b = (torch.as_tensor(x) for x in pair)
    torch.testing.assert_close(b, a, rtol=TOL, atol=TOL, msg=what)


def _same_grads(pair: tuple[dict[str, torch.Tensor], ...], what: str) -> None:
    padded, packed = pair
    assert padded.keys() == packed.keys()
    for name in padded:
        assert padded[name].abs().sum() > 0 or packed[name].abs().sum() == 0, f"{what} {name}"
        _close((padded[name], packed[name]), f"{what} gradient of {name}")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_packed_training_equals_padded(world, world_size: int) -> None:
    _check_parity(world(world_size).run(packing_parity_run, timeout=300), world_size)


@pytest.mark.slow
def test_packed_flash_varlen_training_equals_padded_at_world_2(world) -> None:
    """The packed side through flash's varlen path (the pure-torch reference of ``tests/harness/
    varlen_reference.py``: flattened rows, ``cu_seq_lens``, no mask) in ZeRO-3 engines; the padded side sdpa."""
    _check_parity(world(2).run(packing_parity_run, True, timeout=300), 2, varlen=True)


def _check_parity(results: list[dict[str, dict[str, Any]]], world_size: int, varlen: bool = False) -> None:
    """Every rank's packed numbers equal its padded ones; the ranks' all-reduced gradients are identical."""
    for rank, result in enumerate(results):
        for name in MODEL_NAMES:
            sft, grpo = result[name]["sft"], result[name]["grpo"]
            where = f"world {world_size} rank {rank} {name}"
            _close(sft["loss"], f"{where} SFT loss")
            _same_grads(sft["grads"], f"{where} SFT")
            assert sft["pad"][1] < 0.6 * sft["pad"][0], f"{where} padding share (padded, packed) {sft['pad']}"
            assert not varlen or sft["pad"][1] == 0.0, f"{where}: flash packs one row with no padding slot"
            for key in ("scores", "advantages", "old_logprobs", "loss"):
                _close(grpo[key], f"{where} GRPO {key}")
            _same_grads(grpo["grads"], f"{where} GRPO")
        if rank:  # every rank ends with the same (all-reduced) gradients
            for name in MODEL_NAMES:
                for a, b in zip(results[0][name]["sft"]["grads"], result[name]["sft"]["grads"]):
                    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_packing_samples_end_to_end_at_world_2(world, tmp_path) -> None:
    """``--packing_samples`` through the real steps: SFT, PPO and GRPO runs at world 2 report the same metrics as
    unpacked (fp32; the runs differ only in the forwards' layout, tolerance as above per step)."""
    from tests.workers.rlhf_runs import make_model_dirs, sft_run, step3_run

    pool = world(2)
    actor, value = make_model_dirs(tmp_path / "models")
    sft = {"per_device_train_batch_size": 4, "max_seq_len": 24, "max_steps": 2, "progress": False}
    sft.update(eval_fraction=0.02, print_every=1000, enable_tensorboard=False, learning_rate=3e-3)
    a, b = (pool.run(sft_run, {**sft, "output_dir": str(tmp_path / f"s{p}"), "packing_samples": p})[0] for p in (0, 1))
    for key in ("loss", "eval_loss"):
        _close((a[key], b[key]), f"SFT {key}")
    assert 0.0 <= b["pad_fraction"] <= a["pad_fraction"]
    base = {"actor_model_name_or_path": actor, "critic_model_name_or_path": value, "max_steps": 1, "seed": 5}
    base.update(per_device_generation_batch_size=4, per_device_training_batch_size=2, max_prompt_seq_len=8)
    base.update(max_answer_seq_len=6, progress=False, enable_tensorboard=False, print_every=1000, resume=False)
    for grpo, extra in ((False, {}), (True, {"group_size": 2})):
        runs = [
            pool.run(step3_run, {**base, **extra, "output_dir": str(tmp_path / f"{grpo}{p}"), "packing_samples": p},
                     grpo=grpo, timeout=300)[0]["history"][-1]
            for p in (False, True)
        ]  # fmt: skip
        for key in ("actor_loss", "critic_loss", "reward", "kl"):
            if key in runs[0]:
                _close((runs[0][key], runs[1][key]), f"{'GRPO' if grpo else 'PPO'} {key}")
