"""Hand-computed checks of the GRPO family's math (hybridzero.rlhf.algorithms.grpo): advantages (GRPO, Dr. GRPO, RLOO,
batch scaling, skipped samples, dead groups), DAPO's overlong shaping, the clipped loss at token level (clip-higher)
and sequence level (GSPO), the k3 KL term and the three loss aggregations with global normalisers."""

from __future__ import annotations

import math

import pytest
import torch

from hybridzero.rlhf.algorithms.grpo import (
    aggregate_loss,
    batch_std,
    clipped_policy_loss,
    degenerate_groups,
    group_advantages,
    overlong_penalty,
)
from hybridzero.rlhf.algorithms.ppo import grpo_advantages

F64 = torch.float64
NAN = float("nan")
EPS = 1e-4


def t(rows: object) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def approx(x: torch.Tensor, expected: object, atol: float = 1e-9) -> None:
    torch.testing.assert_close(x, torch.as_tensor(expected, dtype=x.dtype), atol=atol, rtol=0)


# groups of 3: A = [1, 2, 4] (mean 7/3), B = [3, skipped, 5] (mean 4), C = [5, 5, 5] (dead), D = [7, nan, nan] (dead)
REWARDS = [1.0, 2.0, 4.0, 3.0, NAN, 5.0, 5.0, 5.0, 5.0, 7.0, NAN, NAN]


def test_group_mean_without_scaling_is_dr_grpo() -> None:
    adv = group_advantages(t(REWARDS), 3, baseline="group_mean", scale="none")
    approx(adv, [-4 / 3, -1 / 3, 5 / 3, -1.0, 0.0, 1.0] + [0.0] * 6)


def test_group_std_scaling_is_grpo_and_matches_the_old_function() -> None:
    # A: unbiased var ((4/3)^2 + (1/3)^2 + (5/3)^2) / 2 = (42/9) / 2 = 7/3; B: ((-1)^2 + 1^2) / 1 = 2
    sa, sb = math.sqrt(7 / 3) + EPS, math.sqrt(2) + EPS
    adv = group_advantages(t(REWARDS), 3, baseline="group_mean", scale="group")
    approx(adv, [-4 / 3 / sa, -1 / 3 / sa, 5 / 3 / sa, -1 / sb, 0.0, 1 / sb] + [0.0] * 6)
    full = t([1.0, 2.0, 4.0, 5.0, 5.0, 5.0])
    approx(group_advantages(full, 3, baseline="group_mean", scale="group"), grpo_advantages(full, 3))


def test_leave_one_out_baseline_is_rloo() -> None:
    # A: 1 - (2 + 4)/2 = -2, 2 - (1 + 4)/2 = -0.5, 4 - (1 + 2)/2 = 2.5; B (2 scored): 3 - 5 = -2, 5 - 3 = 2
    adv = group_advantages(t(REWARDS), 3, baseline="leave_one_out", scale="none")
    approx(adv, [-2.0, -0.5, 2.5, -2.0, 0.0, 2.0] + [0.0] * 6)


def test_batch_scaling_and_batch_std() -> None:
    approx(torch.tensor(batch_std(4, 10.0, 30.0)), math.sqrt(5 / 3))  # [1, 2, 3, 4]: (30 - 100/4) / 3
    assert batch_std(1, 3.0, 9.0) == 0.0
    adv = group_advantages(t(REWARDS), 3, baseline="group_mean", scale="batch", batch_scale=2.0)
    approx(adv[:3], [-4 / 3 / (2 + EPS), -1 / 3 / (2 + EPS), 5 / 3 / (2 + EPS)])
    with pytest.raises(ValueError, match="batch_scale"):
        group_advantages(t(REWARDS), 3, baseline="group_mean", scale="batch")
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(t(REWARDS), 3, baseline="median", scale="none")
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(t(REWARDS), 5, baseline="group_mean", scale="none")


def test_degenerate_groups() -> None:
    assert degenerate_groups(t(REWARDS), 3).tolist() == [False, False, True, True]
    assert degenerate_groups(t([0.0, 0.0, NAN, 1.0]), 2).tolist() == [True, True]


def test_overlong_penalty_dapo_eq13() -> None:
    # L_max 10, L_cache 4 -> free up to 6; 7 -> (6 - 7)/4 = -0.25; 10 -> -1; beyond -> -1
    lengths = torch.tensor([5, 6, 7, 10, 11])
    approx(overlong_penalty(lengths, max_len=10, buffer=4, penalty=1.0), [0.0, 0.0, -0.25, -1.0, -1.0])
    approx(overlong_penalty(lengths, max_len=10, buffer=4, penalty=0.5), [0.0, 0.0, -0.125, -0.5, -0.5])
    approx(overlong_penalty(lengths, max_len=10, buffer=0, penalty=1.0), [0.0] * 5)


# two answers, old log-probs 0: row 0 (A = 1) ratios 1.5, 0.5; row 1 (A = -2) ratios 1.5, 0.5, 1
LOGP = [[math.log(1.5), math.log(0.5), NAN], [math.log(1.5), math.log(0.5), 0.0]]
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADV = [1.0, -2.0]


def _token_loss(eps_high: float) -> tuple[torch.Tensor, object]:
    logp = t(LOGP).requires_grad_(True)
    out = clipped_policy_loss(
        logp, torch.zeros(2, 3, dtype=F64), None, t(ADV), MASK, eps_low=0.2, eps_high=eps_high, level="token", beta=0.0
    )
    return logp, out


def test_token_level_clip_higher_dapo() -> None:
    # row 0 (A=1): r 1.5 -> min(1.5, 1.28) = 1.28 -> -1.28; r 0.5 -> min(0.5, 0.8) = 0.5 -> -0.5
    # row 1 (A=-2): r 1.5 -> min(-3, -2.56) -> 3; r 0.5 -> min(-1, -1.6) -> 1.6; r 1 -> 2
    _, out = _token_loss(0.28)
    approx(out.per_token, [[-1.28, -0.5, 0.0], [3.0, 1.6, 2.0]])
    approx(out.clip_fraction, 2 / 5)  # row 0 token 0 (above 1.28, A > 0) and row 1 token 1 (below 0.8, A < 0)
    approx(out.approx_kl, 0.5 * 2 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 5)
    _, sym = _token_loss(0.2)  # symmetric clip: 1.5 is cut at 1.2 instead
    approx(sym.per_token[0], [-1.2, -0.5, 0.0])


def test_aggregations_with_global_normalisers() -> None:
    logp, out = _token_loss(0.28)
    # grpo: row means (-1.78 / 2, 6.6 / 3) = (-0.89, 2.2), over 2 answers -> 0.655
    approx(aggregate_loss(out.per_token, MASK, "grpo", num_seqs=2, num_tokens=5, max_len=4).detach(), 0.655)
    # dapo: token sum 4.82 over the batch's 5 tokens
    approx(aggregate_loss(out.per_token, MASK, "dapo", num_seqs=2, num_tokens=5, max_len=4).detach(), 0.964)
    # dr_grpo: token sum over 2 answers x max_len 4
    approx(aggregate_loss(out.per_token, MASK, "dr_grpo", num_seqs=2, num_tokens=5, max_len=4).detach(), 0.6025)
    # one row per "rank" with the global counts: the shares sum to the whole
    for kind in ("grpo", "dapo", "dr_grpo"):
        whole = aggregate_loss(out.per_token, MASK, kind, num_seqs=2, num_tokens=5, max_len=4)
        parts = [
            aggregate_loss(out.per_token[i : i + 1], MASK[i : i + 1], kind, num_seqs=2, num_tokens=5, max_len=4)
            for i in (0, 1)
        ]
        approx(parts[0] + parts[1], whole.detach())
    loss = aggregate_loss(out.per_token, MASK, "dapo", num_seqs=2, num_tokens=5, max_len=4)
    loss.backward()
    # d/dlogp of -A r / 5 where unclipped: row 0 token 1 -0.5/5; row 1 token 0 3/5, token 2 2/5; clipped tokens 0
    approx(logp.grad, [[0.0, -0.1, 0.0], [0.6, 0.0, 0.4]])
    with pytest.raises(ValueError, match="loss_type"):
        aggregate_loss(out.per_token, MASK, "bnpo", num_seqs=2, num_tokens=5, max_len=4)


def test_sequence_level_ratio_gspo() -> None:
    # row 0: s = exp((ln 1.5 + ln 0.5) / 2) = sqrt(0.75); row 1: s = 0.75 ** (1/3); A = 1, -2
    s0, s1 = math.sqrt(0.75), 0.75 ** (1 / 3)
    logp = t(LOGP).requires_grad_(True)
    old = torch.zeros(2, 3, dtype=F64)
    out = clipped_policy_loss(logp, old, None, t(ADV), MASK, eps_low=0.2, eps_high=0.28, level="sequence", beta=0.0)
    approx(out.per_token, [[-s0, -s0, 0.0], [2 * s1, 2 * s1, 2 * s1]])
    approx(out.clip_fraction, 0.0)
    tight = clipped_policy_loss(logp, old, None, t(ADV), MASK, eps_low=0.05, eps_high=0.05, level="sequence", beta=0.0)
    # row 0: s0 = 0.866 < 0.95 with A > 0 -> min(s0, 0.95) = s0 (not clipped); row 1: 0.909 < 0.95 with A < 0 -> 1.9
    approx(tight.per_token, [[-s0, -s0, 0.0], [1.9, 1.9, 1.9]])
    approx(tight.clip_fraction, 3 / 5)  # every token of row 1: the whole answer is clipped together
    aggregate_loss(out.per_token, MASK, "grpo", num_seqs=2, num_tokens=5, max_len=4).backward()
    # row loss -A s, s = exp(mean_t log r_t): d/dlogp_t = -A s / |y|, over 2 answers
    approx(logp.grad, [[-s0 / 2 / 2] * 2 + [0.0], [2 * s1 / 3 / 2] * 3])


def test_k3_kl_term() -> None:
    # one token: logp 0, old 0, ref ln 2 -> d = ln 2, k3 = 2 - ln 2 - 1; A = 0 -> loss is beta * k3 alone
    logp = t([[0.0]]).requires_grad_(True)
    out = clipped_policy_loss(
        logp,
        t([[0.0]]),
        t([[math.log(2)]]),
        t([0.0]),
        torch.ones(1, 1),
        eps_low=0.2,
        eps_high=0.2,
        level="token",
        beta=0.1,
    )
    approx(out.per_token.detach(), [[0.1 * (1 - math.log(2))]])
    approx(out.ref_kl, 1 - math.log(2))
    out.per_token.sum().backward()
    approx(logp.grad, [[0.1 * (1 - 2)]])  # d/dlogp (e^(ref - logp) + logp) = 1 - e^(ref - logp) = -1, x beta
    with pytest.raises(ValueError, match="reference"):
        clipped_policy_loss(
            logp, t([[0.0]]), None, t([0.0]), torch.ones(1, 1), eps_low=0.2, eps_high=0.2, level="token", beta=0.1
        )
    with pytest.raises(ValueError, match="importance_sampling_level"):
        clipped_policy_loss(
            logp, t([[0.0]]), None, t([0.0]), torch.ones(1, 1), eps_low=0.2, eps_high=0.2, level="tok", beta=0.0
        )


def test_used_columns_and_trimmed_experience() -> None:
    from hybridzero.rlhf.rollout.experience import Experience
    from hybridzero.rlhf.rollout.generate import used_columns
    from hybridzero.rlhf.steps.rl.grpo import trim_experience

    # P = 4 (left padded), A = 3 (right padded): real tokens only in columns 1..4
    attention = torch.tensor([[0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0]])
    assert used_columns(attention) == (1, 5)
    assert used_columns(torch.zeros(2, 7, dtype=torch.long)) == (0, 2)
    assert used_columns(torch.tensor([[0, 0, 1, 0]])) == (1, 3)  # one token: still one shifted position
    action = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0]])
    per_token = torch.arange(12, dtype=F64).view(2, 6)
    exp = Experience(attention * 7, attention, action, per_token, per_token + 1, per_token * 0, t([1.0, 2.0]))
    cut = trim_experience(exp.validate()).validate()
    assert cut.sequences.shape == (2, 4) and cut.logprobs.shape == (2, 3)
    assert cut.action_mask.tolist() == [[0, 0, 0], [0, 0, 1]]  # columns 1..3 of the shifted space
    assert cut.logprobs.tolist() == [[1.0, 2.0, 3.0], [7.0, 8.0, 9.0]] and cut.rewards.tolist() == [1.0, 2.0]
