"""Hand-computed checks of the RLHF math (hybridzero.rlhf): rewards, GAE, whitening, PPO/GRPO losses, records."""

from __future__ import annotations

import math

import pytest
import torch

from hybridzero.rlhf import (
    Experience,
    PPOSettings,
    clipped_value_loss,
    gae,
    gather_logprobs,
    grpo_advantages,
    grpo_loss,
    kl_penalized_rewards,
    last_action_index,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
)

F64 = torch.float64
NAN = float("nan")


def t(rows: object) -> torch.Tensor:
    """A float64 tensor from (nested) float lists."""
    return torch.tensor(rows, dtype=F64)


def approx(x: torch.Tensor, expected: object, atol: float = 1e-9) -> None:
    """``x == expected`` up to ``atol`` (absolute), in ``x``'s dtype."""
    torch.testing.assert_close(x, torch.as_tensor(expected, dtype=x.dtype), atol=atol, rtol=0)


def _batch() -> Experience:
    """B=3, T=6, prompt width P=3 (left-padded, pad id 0); answers of length 3, 1 and 0.

    Shifted position t <-> token t+1, so the answer tokens 3..5 are positions 2..4.
    """
    sequences = torch.tensor(
        [
            [0, 5, 6, 7, 8, 9],  # prompt [pad 5 6], answer [7 8 9]
            [5, 6, 7, 8, 0, 0],  # prompt [5 6 7],   answer [8] + right padding
            [0, 0, 5, 0, 0, 0],
        ]
    )  # prompt [pad pad 5], empty answer
    attention_mask = (sequences != 0).long()
    action_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]])
    logprobs = t([[9.0, 9.0, -1.0, -2.0, -0.5], [9.0, 9.0, -1.0, NAN, NAN], [NAN] * 5])
    ref_logprobs = t([[0.0, 0.0, -1.5, -1.0, -0.5], [0.0, 0.0, -3.0, NAN, NAN], [NAN] * 5])
    return Experience(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        values=torch.zeros(3, 5, dtype=F64),
        rewards=t([7.0, -2.0, 3.0]),
    )


# ----------------------------------------------------------------------------------------------- gather_logprobs
def test_gather_logprobs_hand_values_and_upcast() -> None:
    # softmax([0, 0, ln2]) = [1/4, 1/4, 1/2] -> label 2: ln 0.5
    # softmax([ln3, 0, 0]) = [3/5, 1/5, 1/5] -> label 1: ln 0.2
    logits = t([[[0.0, 0.0, math.log(2)], [math.log(3), 0.0, 0.0]]])
    out = gather_logprobs(logits, torch.tensor([[2, 1]]))
    approx(out, [[math.log(0.5), math.log(0.2)]])
    low = gather_logprobs(logits.to(torch.bfloat16), torch.tensor([[2, 1]]))
    assert low.dtype == torch.float32 and low.shape == (1, 2)
    with pytest.raises(ValueError, match="labels"):
        gather_logprobs(logits, torch.tensor([[2, 1, 0]]))


# ------------------------------------------------------------------------------------------------------- rewards
def test_last_action_index_variable_lengths_and_empty_row() -> None:
    assert last_action_index(_batch().action_mask).tolist() == [4, 2, -1]


def test_kl_penalized_rewards_variable_lengths() -> None:
    exp = _batch().validate()
    out = kl_penalized_rewards(
        exp.logprobs, exp.ref_logprobs, exp.rewards, exp.action_mask, kl_coef=0.1, clip_reward=5.0
    )
    # row 0: logp - ref on actions = [0.5, -1.0, 0.0] -> -0.1 * . = [-0.05, 0.1, 0]; score 7 clipped to 5 at pos 4
    # row 1: logp - ref = 2.0 -> -0.2; score -2 (inside the clip) added at its only action, pos 2 -> -2.2
    #        (DS-Chat's ends = start + 1 + 1 = 4 would put it on pos 3, the masked-out pad slot)
    # row 2: no action -> no KL and no score; nan garbage outside the mask never leaks
    approx(out, [[0.0, 0.0, -0.05, 0.1, 5.0], [0.0, 0.0, -2.2, 0.0, 0.0], [0.0] * 5])


def test_kl_penalized_rewards_clips_negative_scores() -> None:
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = kl_penalized_rewards(t([[0.0, 0.0]]), t([[0.0, 0.0]]), t([-9.0]), mask, kl_coef=0.1, clip_reward=5.0)
    approx(out, [[0.0, -5.0]])


def _ds_chat_reference(
    logp: torch.Tensor, ref: torch.Tensor, score: torch.Tensor, values: torch.Tensor, start: int, hp: PPOSettings
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DS-Chat's start/ends formulation, valid when every answer fills the width (then ends clamps to L)."""
    rewards = -hp.kl_ctl * (logp - ref)
    rewards[:, -1] += score.clamp(-hp.clip_reward_value, hp.clip_reward_value)
    length, last, advs = rewards.shape[1], torch.zeros(rewards.shape[0], dtype=F64), []
    for step in reversed(range(start, length)):
        nxt = values[:, step + 1] if step < length - 1 else 0.0
        last = rewards[:, step] + hp.gamma * nxt - values[:, step] + hp.gamma * hp.lambd * last
        advs.append(last)
    adv = torch.stack(advs[::-1], dim=1)
    return rewards, adv, adv + values[:, start:]


def test_matches_ds_chat_on_full_width_answers() -> None:
    gen, hp, start = torch.Generator().manual_seed(0), PPOSettings(), 3  # DeepSpeed-Chat's defaults
    logp, ref, values = (torch.randn(4, 8, generator=gen, dtype=F64) for _ in range(3))
    score = 4 * torch.randn(4, generator=gen, dtype=F64)
    mask = torch.zeros(4, 8, dtype=torch.bool)
    mask[:, start:] = True
    rewards = kl_penalized_rewards(logp, ref, score, mask, kl_coef=hp.kl_ctl, clip_reward=hp.clip_reward_value)
    adv, ret = gae(rewards, values, mask, gamma=hp.gamma, lam=hp.lambd)
    ds_rewards, ds_adv, ds_ret = _ds_chat_reference(logp, ref, score, values, start, hp)
    torch.testing.assert_close(rewards[:, start:], ds_rewards[:, start:])
    torch.testing.assert_close(adv[:, start:], ds_adv)
    torch.testing.assert_close(ret[:, start:], ds_ret)
    assert not adv[:, :start].any() and not ret[:, :start].any()


# ----------------------------------------------------------------------------------------------------------- gae
def test_gae_lam_zero_is_td0() -> None:
    # gamma=0.9, lam=0 -> A_t = r_t + 0.9 V_next - V_t over actions [1, 2, 3]; V after the last = 0
    # t=3: 3 + 0 - 1.5 = 1.5        R = 1.5 + 1.5 = 3.0
    # t=2: 2 + 0.9*1.5 - 1.0 = 2.35  R = 3.35
    # t=1: 1 + 0.9*1.0 - 0.5 = 1.4   R = 1.9
    rewards, values = t([[100.0, 1.0, 2.0, 3.0]]), t([[50.0, 0.5, 1.0, 1.5]])
    adv, ret = gae(rewards, values, torch.tensor([[0, 1, 1, 1]]), gamma=0.9, lam=0.0)
    approx(adv, [[0.0, 1.4, 2.35, 1.5]])
    approx(ret, [[0.0, 1.9, 3.35, 3.0]])


def test_gae_gamma_lam_one_returns_are_future_reward_sums() -> None:
    # returns = [_, 1+2+3, 2+3, 3] = [_, 6, 5, 3]; advantages = returns - values
    rewards, values = t([[100.0, 1.0, 2.0, 3.0]]), t([[50.0, 0.5, 1.0, 1.5]])
    adv, ret = gae(rewards, values, torch.tensor([[0, 1, 1, 1]]), gamma=1.0, lam=1.0)
    approx(ret, [[0.0, 6.0, 5.0, 3.0]])
    approx(adv, [[0.0, 5.5, 4.0, 1.5]])


def test_gae_padding_holes_and_empty_rows() -> None:
    rewards = t([[0.0, 1.0, 3.0, NAN], [1.0, 100.0, 2.0, 0.0], [NAN] * 4])
    values = t([[9.0, 1.0, 2.0, NAN], [0.5, 7.0, 1.0, 0.0], [NAN] * 4])
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # row 0 (prompt, 2 answer tokens, pad): t=2: delta = 3 - 2 = 1, A = 1, R = 3
    #                                       t=1: delta = 1 + 0.5*2 - 1 = 1, A = 1 + 0.25*1 = 1.25, R = 2.25
    # row 1 (hole at t=1 is skipped): t=2: delta = 2 - 1 = 1, A = 1, R = 2
    #                                 t=0: delta = 1 + 0.5*1 - 0.5 = 1, A = 1 + 0.25*1 = 1.25, R = 1.75
    approx(adv, [[0.0, 1.25, 1.0, 0.0], [1.25, 0.0, 1.0, 0.0], [0.0] * 4])
    approx(ret, [[0.0, 2.25, 3.0, 0.0], [1.75, 0.0, 2.0, 0.0], [0.0] * 4])


# ---------------------------------------------------------------------------------------------- masked statistics
def test_masked_mean_var_whiten_hand_values() -> None:
    x, mask = t([[1.0, 2.0, 3.0, NAN]]), torch.tensor([[1, 1, 1, 0]])
    approx(masked_mean(x, mask), 2.0)  # (1 + 2 + 3) / 3
    approx(masked_var(x, mask), 1.0)  # unbiased: (1 + 0 + 1) / (3 - 1)
    approx(masked_var(x, mask, unbiased=False), 2.0 / 3.0)  # biased: (1 + 0 + 1) / 3
    approx(masked_whiten(x, mask), [[-1.0, 0.0, 1.0, 0.0]], atol=1e-7)  # (x - 2) / sqrt(1 + 1e-8)
    approx(masked_whiten(x, mask, shift_mean=False), [[1.0, 2.0, 3.0, 0.0]], atol=1e-7)
    approx(masked_mean(t([[1.0, 3.0], [5.0, NAN]]), torch.tensor([[1, 1], [1, 0]]), dim=1), [2.0, 5.0])


def test_masked_stats_edge_cases() -> None:
    const, mask = torch.full((2, 3), 3.0, dtype=F64), torch.tensor([[1, 1, 1], [1, 0, 0]])
    approx(masked_whiten(const, mask), [[0.0] * 3] * 2)  # var 0 -> all zeros
    approx(masked_whiten(const, mask, shift_mean=False), [[3.0] * 3, [3.0, 0.0, 0.0]])
    approx(masked_mean(t([[1.0, 2.0]]), torch.zeros(1, 2)), 0.0)  # empty mask -> 0, not nan
    approx(masked_var(t([[4.0, NAN]]), torch.tensor([[1, 0]]), unbiased=False), 0.0)
    with pytest.raises(ValueError, match="1 element"):
        masked_var(t([[4.0, NAN]]), torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="0 element"):
        masked_whiten(t([[4.0]]), torch.tensor([[0]]))


# ---------------------------------------------------------------------------------------------------- PPO losses
def test_ppo_policy_loss_hand_values_and_gradients() -> None:
    # tokens (ratio, A): a (1.0, 1) e (1.0, 0) b (1.5, 2) | c (1.5, -1) d (0.5, -1), clip 0.2
    # max(-A r, -A clip(r)): a -1; e 0; b max(-3, -2.4) = -2.4 (clipped); c max(1.5, 1.2) = 1.5; d max(0.5, 0.8) = 0.8
    # token mean over 5 tokens: (-1 + 0 - 2.4 + 1.5 + 0.8) / 5 = -0.22 (a per-sequence mean would give -0.4917)
    lr = [0.0, 0.0, math.log(1.5), math.log(1.5), math.log(0.5)]
    logp = t([[lr[0], lr[1], lr[2]], [lr[3], lr[4], NAN]]).requires_grad_(True)
    old = torch.zeros(2, 3, dtype=F64)
    adv = t([[1.0, 0.0, 2.0], [-1.0, -1.0, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, stats = ppo_policy_loss(logp, old, adv, mask, clip=0.2)
    approx(loss.detach(), -0.22)
    approx(stats.clip_fraction, 2 / 5)  # b (high, A > 0) and d (low, A < 0)
    approx(stats.approx_kl, 0.5 * (2 * math.log(1.5) ** 2 + math.log(0.5) ** 2) / 5)
    assert stats.ref_kl is None
    loss.backward()
    # d/dlogp of -A r / 5 = -A r / 5 on unclipped tokens, 0 on clipped ones and outside the mask
    approx(logp.grad, [[-0.2, 0.0, 0.0], [0.3, 0.0, 0.0]])


def test_ppo_clip_fraction_at_the_boundaries() -> None:
    eps = 1e-6
    ratios = [1.2 + eps, 1.2 - eps, 0.8 - eps, 0.8 + eps, 3.0]
    adv = t([[1.0, 1.0, -1.0, -1.0, 0.0]])
    logp = t([[math.log(r) for r in ratios]])
    _, stats = ppo_policy_loss(logp, torch.zeros_like(logp), adv, torch.ones(1, 5), clip=0.2)
    approx(stats.clip_fraction, 2 / 5)  # just past 1.2 with A > 0 and just under 0.8 with A < 0; A = 0 never clips
    _, on_policy = ppo_policy_loss(logp, logp, adv, torch.ones(1, 5), clip=0.2)
    approx(on_policy.clip_fraction, 0.0)
    approx(on_policy.approx_kl, 0.0)


def test_clipped_value_loss_hand_values() -> None:
    # (V, V_old, R) -> V_clip = clamp(V, V_old +- 0.2); max((V-R)^2, (V_clip-R)^2)
    # (1.0, 0.5, 1.0): V_clip 0.7 -> max(0, 0.09) = 0.09
    # (0.6, 0.5, 2.0): V_clip 0.6 -> max(1.96, 1.96) = 1.96
    # (0.0, 0.5, 1.0): V_clip 0.3 -> max(1, 0.49) = 1
    # loss = 0.5 * (0.09 + 1.96 + 1) / 3 = 0.508333...
    values, old = t([[1.0, 0.6], [0.0, NAN]]), t([[0.5, 0.5], [0.5, NAN]])
    returns, mask = t([[1.0, 2.0], [1.0, NAN]]), torch.tensor([[1, 1], [1, 0]])
    approx(clipped_value_loss(values, old, returns, mask, clip=0.2), 0.5 * 3.05 / 3)
    approx(clipped_value_loss(values, old, returns, torch.zeros(2, 2), clip=0.2), 0.0)


# ----------------------------------------------------------------------------------------------------------- GRPO
def test_grpo_advantages_hand_values() -> None:
    rewards = t([1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 0.1, 0.1, 0.1])
    # group 1: mean 2, unbiased std 1 -> (r - 2) / 1.0001; groups 2 and 3 are all equal -> exact zeros
    expected = [-1 / 1.0001, 0.0, 1 / 1.0001] + [0.0] * 6
    approx(grpo_advantages(rewards, 3), expected)
    assert (grpo_advantages(rewards, 3)[3:] == 0).all()
    # [0, 4]: mean 2, unbiased std sqrt(8) -> +-2 / (sqrt(8) + 1e-4)
    approx(grpo_advantages(t([0.0, 4.0]), 2), [-2 / (math.sqrt(8) + 1e-4), 2 / (math.sqrt(8) + 1e-4)])
    approx(grpo_advantages(rewards, 3, scale_by_std=False)[:3], [-1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(rewards, 4)
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(rewards, 1)


def test_grpo_loss_hand_values() -> None:
    # row 0 (A=1, 2 tokens): ratios 1 and 1.5, ref = logp -> k3 = 0; surrogate min(r, clip(r)) = 1, 1.2
    #     -> per-token [-1, -1.2], row mean -1.1
    # row 1 (A=-0.5, 1 token): ratio 1, d = ref - logp = ln 2 -> k3 = 2 - ln2 - 1 = 0.30685
    #     -> 0.5 + 0.1 * 0.30685 = 0.530685
    # row 2: empty -> contributes 0 but counts: loss = (-1.1 + 0.530685 + 0) / 3
    k3 = 1 - math.log(2)
    logp = t([[0.0, math.log(1.5), NAN], [NAN, 0.0, NAN], [NAN] * 3]).requires_grad_(True)
    old = t([[0.0, 0.0, NAN], [NAN, 0.0, NAN], [NAN] * 3])
    ref = t([[0.0, math.log(1.5), NAN], [NAN, math.log(2), NAN], [NAN] * 3])
    mask = torch.tensor([[1, 1, 0], [0, 1, 0], [0, 0, 0]])
    adv = t([1.0, -0.5, 7.0])
    loss, stats = grpo_loss(logp, old, ref, adv, mask, clip=0.2, kl_coef=0.1)
    approx(loss.detach(), (-1.1 + 0.5 + 0.1 * k3) / 3)
    approx(stats.clip_fraction, 1 / 3)
    approx(stats.approx_kl, 0.5 * math.log(1.5) ** 2 / 3)
    assert stats.ref_kl is not None
    approx(stats.ref_kl, k3 / 3)
    no_kl, _ = grpo_loss(logp, old, ref, adv, mask, clip=0.2, kl_coef=0.0)
    approx(no_kl.detach(), (-1.1 + 0.5) / 3)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and not logp.grad[2].any()


def test_grpo_equal_rewards_give_no_policy_gradient() -> None:
    adv = grpo_advantages(t([2.0, 2.0, 2.0, 2.0]), 4)
    logp = t([[-1.0, -2.0]] * 4).requires_grad_(True)
    loss, _ = grpo_loss(logp, logp.detach() + 0.3, logp.detach(), adv, torch.ones(4, 2), clip=0.2, kl_coef=0.0)
    loss.backward()
    approx(loss.detach(), 0.0)
    approx(logp.grad, [[0.0, 0.0]] * 4)


# ------------------------------------------------------------------------------------------------------ Experience
def test_experience_validate_accepts_a_good_batch() -> None:
    exp = _batch()
    assert exp.validate() is exp
    assert exp.batch_size == 3 and exp.num_actions.tolist() == [3, 1, 0]
    assert exp.to("cpu").validate().rewards.tolist() == [7.0, -2.0, 3.0]
    with pytest.raises(AttributeError):
        exp.rewards = t([0.0, 0.0, 0.0])  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("logprobs", torch.zeros(3, 6, dtype=F64), r"logprobs: shape \(3, 6\) .* expected \(3, 5\)"),
        ("rewards", torch.zeros(3, 1, dtype=F64), r"rewards: shape \(3, 1\) .* expected \(3,\)"),
        ("attention_mask", torch.ones(2, 6, dtype=torch.long), r"attention_mask: shape \(2, 6\) .* expected \(3, 6\)"),
        ("action_mask", torch.ones(3, 6, dtype=torch.long), r"action_mask: shape \(3, 6\) .* expected \(3, 5\)"),
        ("sequences", torch.zeros(3, 6), "sequences: expected integer"),
        ("values", torch.zeros(3, 5, dtype=torch.long), "values: expected a floating dtype"),
        ("action_mask", torch.zeros(3, 5), "action_mask: expected a bool or integer mask"),
        ("action_mask", torch.full((3, 5), 2), "action_mask: mask values must be 0 or 1"),
        ("action_mask", torch.ones(3, 5, dtype=torch.long), "action_mask: marks positions whose token is padding"),
    ],
)
def test_experience_validate_errors(field: str, value: torch.Tensor, message: str) -> None:
    fields = {name: getattr(_batch(), name) for name in Experience.__dataclass_fields__}
    fields[field] = value
    with pytest.raises(ValueError, match=message):
        Experience(**fields).validate()
