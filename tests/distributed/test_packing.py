"""Packed = padded training through ZeRO-3 engines at world 1, 2 and 4 (Llama, OPT and GPT-2 shapes, sdpa, fp32).

Each rank trains on its own data; the engine averages gradients over ranks, so a packed forward on any rank that
differed from its padded one would show in every rank's full gradients. Tolerance: see
``tests/unit/test_packing.py`` (fp32, reduction order only): ``rtol = atol = 2e-5``; gradients are additionally
averaged over ranks (one more reduction of at most 4 terms).
"""

from __future__ import annotations

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
    results = world(world_size).run(packing_parity_run, timeout=300)
    for rank, result in enumerate(results):
        for name in MODEL_NAMES:
            sft, grpo = result[name]["sft"], result[name]["grpo"]
            where = f"world {world_size} rank {rank} {name}"
            _close(sft["loss"], f"{where} SFT loss")
            _same_grads(sft["grads"], f"{where} SFT")
            assert sft["pad"][1] < 0.6 * sft["pad"][0], f"{where} padding share (padded, packed) {sft['pad']}"
            for key in ("scores", "advantages", "old_logprobs", "loss"):
                _close(grpo[key], f"{where} GRPO {key}")
            _same_grads(grpo["grads"], f"{where} GRPO")
        if rank:  # every rank ends with the same (all-reduced) gradients
            for name in MODEL_NAMES:
                for a, b in zip(results[0][name]["sft"]["grads"], result[name]["sft"]["grads"]):
                    assert all(torch.equal(a[k], b[k]) for k in a)
