"""``--max_tokens_per_batch``: token-budgeted chunks train exactly as the whole packed micro-batch (fp32, gloo).

World 1 and 2, ZeRO-3, SGD (lr 0.1) with gradient accumulation 2, two optimizer steps; rank 1 holds one more
sequence, so the ranks run different numbers of real chunks (stand-ins keep the collective forwards aligned).
Checked: every micro-step's loss (and GRPO/PPO clip statistics), the first micro-step's full gradients (SFT), the
full parameters after the steps, the experience forwards (log-probs, values, scores) and the engine's counters
(``micro_steps``/``global_steps`` identical: one micro-step per micro-batch however many chunks).

Tolerance: the chunked side computes the same per-token terms on the same inputs; what differs is (a) the packed
row layout (attention over a wider row whose extra keys are masked out: reduction order, as in
``tests/unit/test_packing.py``, ``2e-5``) and (b) the loss as a sum of chunk sums instead of one sum (fp32
reassociation: relative error ``<= n * eps`` for ``n`` <= 60 terms, ~1e-5) and the gradients accumulated over
several backwards into the fp32 shards (a handful of extra additions per entry). All three are fp32 rounding of
O(1) quantities, so absolute and relative ``2e-5`` (``atol`` scaled by the largest gradient entry for gradients)
bound them; a wrong chunk weight or a missed chunk moves the numbers by >= 1e-2 of their size.
"""

from __future__ import annotations

import pytest
import torch

from tests.workers.token_budget import grpo_budget_run, ppo_budget_run, reward_budget_run, sft_budget_run

TOL = 2e-5


def _close(a: object, b: object, what: str, scale: float = 1.0) -> None:
    torch.testing.assert_close(torch.as_tensor(b), torch.as_tensor(a), rtol=TOL, atol=TOL * scale, msg=what)


def _same_tensors(pair: tuple[dict[str, torch.Tensor], ...], what: str) -> None:
    whole, chunked = pair
    assert whole.keys() == chunked.keys()
    scale = max(float(t.abs().max()) for t in whole.values())
    for name in whole:
        _close(whole[name], chunked[name], f"{what} {name}", max(scale, 1.0))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_sft_token_budget_equals_whole_micro_batch(world, world_size: int) -> None:
    results = world(world_size).run(sft_budget_run, "llama", timeout=300)
    for rank, r in enumerate(results):
        where = f"world {world_size} rank {rank} SFT"
        assert min(r["chunks"]) >= 2, f"{where}: the budget must split every micro-batch, got {r['chunks']}"
        for i, (a, b) in enumerate(r["loss"]):
            _close(a, b, f"{where} loss of micro-step {i}")
        _same_tensors(r["grads"], f"{where} gradient")
        _same_tensors(r["params"], f"{where} parameter after 2 steps")
        assert r["counters"][0] == r["counters"][1] == (4, 2), f"{where} (micro_steps, global_steps)"
        assert r["nested_refused"], f"{where}: a nested backward_group must be refused"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_reward_token_budget_equals_whole_micro_batch(world, world_size: int) -> None:
    for rank, r in enumerate(world(world_size).run(reward_budget_run, "llama", timeout=300)):
        where = f"world {world_size} rank {rank} reward"
        for i, (a, b, n_a, n_b) in enumerate(r["loss"]):
            _close(a, b, f"{where} summed pair loss of micro-step {i}")
            assert n_a == n_b, f"{where} pair count {n_a} != {n_b}"
        _same_tensors(r["params"], f"{where} parameter after 2 steps")
        assert r["counters"][0] == r["counters"][1] == (4, 2), f"{where} counters"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_grpo_ppo_token_budget_equals_whole_mini_batch(world, world_size: int) -> None:
    pool = world(world_size)
    grpo = pool.run(grpo_budget_run, "llama", timeout=300)
    ppo = pool.run(ppo_budget_run, "llama", timeout=300)
    for rank in range(world_size):
        g, p = grpo[rank], ppo[rank]
        where = f"world {world_size} rank {rank}"
        for i, row in enumerate(g["loss"]):
            _close(row[0], row[1], f"{where} GRPO loss {i}")
            _close(row[2], row[3], f"{where} GRPO clip fraction {i}")
        _same_tensors(g["params"], f"{where} GRPO parameter")
        assert g["counters"][0] == g["counters"][1] == (4, 2), f"{where} GRPO counters"
        for key in ("logprobs", "values", "scores"):
            _close(*p[key], f"{where} experience {key}")
        for i, row in enumerate(p["loss"]):
            for j in range(0, len(row), 2):
                _close(row[j], row[j + 1], f"{where} PPO stat {j // 2} of update {i}")
        for k, role in enumerate(("actor", "critic")):
            _same_tensors((p["params"][0][k], p["params"][1][k]), f"{where} PPO {role} parameter")
        assert p["counters"][0] == p["counters"][1] == (4, 2), f"{where} PPO counters"


@pytest.mark.slow
def test_max_tokens_per_batch_end_to_end_at_world_2(world, tmp_path) -> None:
    """``--max_tokens_per_batch`` through the real steps: SFT, PPO and GRPO runs at world 2 report the metrics of
    the packed runs without a budget (fp32; tolerance as above)."""
    from tests.workers.rlhf_runs import make_model_dirs, sft_run, step3_run

    pool = world(2)
    actor, value = make_model_dirs(tmp_path / "models")
    sft = {"per_device_train_batch_size": 4, "max_seq_len": 24, "max_steps": 2, "progress": False}
    sft.update(eval_fraction=0.02, print_every=1000, enable_tensorboard=False, learning_rate=3e-3)
    sft.update(packing_samples=True)
    a, b = (
        pool.run(sft_run, {**sft, "output_dir": str(tmp_path / f"s{n}"), "max_tokens_per_batch": n})[0]
        for n in (None, 24)
    )
    for key in ("loss", "eval_loss"):
        _close(a[key], b[key], f"SFT {key}")
    base = {"actor_model_name_or_path": actor, "critic_model_name_or_path": value, "max_steps": 1, "seed": 5}
    base.update(per_device_generation_batch_size=4, per_device_training_batch_size=2, max_prompt_seq_len=8)
    base.update(max_answer_seq_len=6, progress=False, enable_tensorboard=False, print_every=1000, resume=False)
    base.update(packing_samples=True)
    for grpo, extra in ((False, {}), (True, {"group_size": 2})):
        runs = [
            pool.run(step3_run, {**base, **extra, "output_dir": str(tmp_path / f"{grpo}{n}"),
                                 "max_tokens_per_batch": n}, grpo=grpo, timeout=300)[0]["history"][-1]
            for n in (None, 14)
        ]  # fmt: skip
        for key in ("actor_loss", "critic_loss", "reward", "kl"):
            if key in runs[0]:
                _close(runs[0][key], runs[1][key], f"{'GRPO' if grpo else 'PPO'} {key}")


@pytest.mark.parametrize("world_size", [1, 2])
def test_ptx_and_evaluation_token_budget_equal_whole(world, world_size: int) -> None:
    """``--max_tokens_per_batch`` also chunks the ptx step (``ptx_update``: same loss, same parameters after two
    steps, one micro-step each) and the SFT and reward-model evaluations (same metrics); tolerance as above."""
    from tests.workers.token_budget import ptx_eval_budget_run

    for rank, r in enumerate(world(world_size).run(ptx_eval_budget_run, "llama", timeout=300)):
        where = f"world {world_size} rank {rank}"
        for i, (a, b) in enumerate(r["ptx"]):
            _close(a, b, f"{where} ptx loss of step {i}")
        _same_tensors(r["params"], f"{where} parameter after 2 ptx steps")
        assert r["counters"][0] == r["counters"][1] == (2, 1), f"{where} (micro_steps, global_steps)"
        _close(*r["sft_eval"], f"{where} SFT eval_loss")
        whole, chunked = r["reward_eval"]
        assert whole.keys() == chunked.keys()
        for key in whole:
            _close(whole[key], chunked[key], f"{where} reward {key}")
