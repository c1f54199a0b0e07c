"""Pure functions for the RLHF math: DeepSpeed-Chat step-3 PPO and GRPO.

Conventions shared by every function here:

* Per-token tensors are ``[B, L]`` in the *shifted* space (``L = T - 1`` for ``T``-token sequences): position t
  describes token t+1. ``action_mask`` (bool or 0/1 integer) selects the generated answer tokens; prompts, left and
  right padding are 0. Answers may have different lengths, and a row may be all zero.
* Masking uses ``torch.where`` rather than multiplication, so garbage (even inf/nan) at masked positions never
  leaks into a result. Per-token outputs are exactly 0 outside the mask.
* "Masked mean" over a batch is the *token* mean: sum over all action tokens / number of action tokens (DS-Chat's
  ``sum(x * mask) / mask.sum()``); an empty mask gives 0 instead of nan.
* Nothing here calls ``backward`` or mutates its inputs; losses are differentiable in ``logprobs`` / ``values``.
* Coefficients (``kl_coef``, ``clip``, ``gamma``, ``lam``, ...) are keyword-only without defaults: their defaults
  live once, in :mod:`hybridzero.rlhf.settings`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WHITEN_EPS: float = 1e-8
GRPO_EPS: float = 1e-4


@dataclass(frozen=True)
class PolicyLossStats:
    """Detached scalar diagnostics of a policy loss (token means over the action mask).

    * ``clip_fraction``: share of action tokens whose clipped branch is the active (pessimistic) one, i.e.
      ``ratio > 1 + clip`` with ``A > 0`` or ``ratio < 1 - clip`` with ``A < 0`` (strict: a ratio exactly on the
      boundary is not clipped).
    * ``approx_kl``: ``0.5 * mean((logp - old_logp)^2)``, the old->new policy drift (TRL's estimator).
    * ``ref_kl``: mean k3 estimate of KL(new || ref) (GRPO only; ``None`` for PPO).
    """

    clip_fraction: torch.Tensor
    approx_kl: torch.Tensor
    ref_kl: torch.Tensor | None = None


def _check_shapes(reference: str, **tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every tensor has the shape of ``tensors[reference]``."""
    expected = tuple(tensors[reference].shape)
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match {reference} shape {expected}")


def gather_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``out[b, t] = log softmax(logits[b, t])[labels[b, t]]``; logits ``[B, T, V]``, labels ``[B, T]`` -> ``[B, T]``.

    The caller shifts: ``gather_logprobs(logits[:, :-1], sequences[:, 1:])`` gives the ``[B, T-1]`` shifted-space
    log-probabilities of :class:`~hybridzero.rlhf.rollout.experience.Experience`. Computed in float32 (or wider) as
    ``logit[label] - logsumexp(logits)``.
    """
    if logits.dim() != 3 or tuple(labels.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"labels: shape {tuple(labels.shape)} does not match logits[..., 0] shape "
            f"{tuple(logits.shape[:2])} (logits shape {tuple(logits.shape)})"
        )
    wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    picked = wide.gather(dim=-1, index=labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(wide, dim=-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x[mask]) / count(mask)`` over ``dim`` (all dims when ``None``); 0 where the mask is empty."""
    m = mask.bool()
    total = torch.where(m, x, torch.zeros_like(x))
    if dim is None:
        return total.sum() / m.sum().clamp(min=1).to(x.dtype)
    return total.sum(dim=dim) / m.sum(dim=dim).clamp(min=1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x[mask]`` (a scalar). Unbiased (Bessel, ``n / (n - 1)``) by default, as TRL's ``masked_var``.

    Raises ``ValueError`` if the mask selects fewer than 2 elements with ``unbiased=True`` (or none at all).
    """
    count = int(mask.bool().sum())
    if count == 0 or (unbiased and count < 2):
        raise ValueError(f"masked_var: mask selects {count} element(s); need at least {2 if unbiased else 1}")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return var * (count / (count - 1)) if unbiased else var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = WHITEN_EPS
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and *unbiased* variance over ``x[mask]`` (TRL's convention).

    With ``shift_mean=False`` the mean is added back (only the scale changes). Positions outside the mask are 0.
    A constant input has var 0, so it whitens to 0 (or to the constant with ``shift_mean=False``).
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def last_action_index(action_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: the largest position t with ``action_mask[b, t] == 1``, or -1 for an all-zero row."""
    positions = torch.arange(action_mask.shape[-1], device=action_mask.device).expand_as(action_mask)
    return torch.where(action_mask.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values


def kl_penalized_rewards(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    kl_coef: float,
    clip_reward: float,
) -> torch.Tensor:
    """Per-token PPO rewards ``[B, L]``: a KL penalty on every action token plus the clipped score at the last one.

    ``r[b, t] = -kl_coef * (logprobs[b, t] - ref_logprobs[b, t])`` where ``action_mask[b, t]``, else 0; then
    ``r[b, last_b] += clamp(rewards[b], -clip_reward, clip_reward)`` with ``last_b = last_action_index(mask)[b]``.
    An all-zero row gets no reward at all (all zeros).

    DS-Chat differs: it uses one shared ``start = P - 1`` and ``ends = start + count + 1``, which puts the score one
    slot *past* the last action token (on the pad/eos slot the actor loss masks out) when an answer is shorter than
    the batch width, but on the last token when the answer fills it; it also leaves KL terms on prompt/pad slots
    and zeroes them later. Here the score always lands on the last token where the mask is 1, for every length.
    """
    _check_shapes("logprobs", logprobs=logprobs, ref_logprobs=ref_logprobs, action_mask=action_mask)
    if tuple(rewards.shape) != (logprobs.shape[0],):
        raise ValueError(f"rewards: shape {tuple(rewards.shape)} does not match expected ({logprobs.shape[0]},)")
    m = action_mask.bool()
    penalty = -kl_coef * (logprobs - ref_logprobs)
    out = torch.where(m, penalty, torch.zeros_like(penalty))
    last = last_action_index(m)
    score = rewards.to(out.dtype).clamp(-clip_reward, clip_reward)
    score = torch.where(last >= 0, score, torch.zeros_like(score))
    return out.scatter_add(1, last.clamp(min=0).unsqueeze(1), score.unsqueeze(1))


def gae(
    rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over action tokens; returns ``(advantages, returns)``, both ``[B, L]``.

    Reverse scan over the action tokens of each row, with ``next`` the following *action* token (non-action
    positions are skipped, so a hole in the mask is not a step) and ``V = 0`` after the last action token::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next
        R_t     = A_t + V_t

    Outside the mask both outputs are 0. ``lam = 0`` gives TD(0) (``A_t = delta_t``); ``gamma = lam = 1`` gives
    ``R_t = sum_{k >= t} r_k`` (Monte-Carlo return). For contiguous answers this equals DS-Chat's
    ``get_advantages_and_returns`` after it zeroes rewards/values past ``ends``.
    """
    _check_shapes("values", rewards=rewards, values=values, action_mask=action_mask)
    m = action_mask.bool()
    zeros = torch.zeros_like(values[:, 0])
    next_value, next_adv = zeros, zeros
    columns: list[torch.Tensor] = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        columns.append(torch.where(m[:, t], adv, zeros))
        next_value = torch.where(m[:, t], values[:, t], next_value)
        next_adv = torch.where(m[:, t], adv, next_adv)
    if not columns:
        return torch.zeros_like(values), torch.zeros_like(values)
    advantages = torch.stack(columns[::-1], dim=1)
    returns = torch.where(m, advantages + values, torch.zeros_like(values))
    return advantages, returns


def _clip_stats(
    ratio: torch.Tensor, advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(clip fraction, approx KL) as documented on :class:`PolicyLossStats`; detached."""
    with torch.no_grad():
        high = (ratio > 1.0 + clip) & (advantages > 0)
        low = (ratio < 1.0 - clip) & (advantages < 0)
        clip_fraction = masked_mean((high | low).to(ratio.dtype), mask)
        approx_kl = 0.5 * masked_mean(log_ratio.detach() ** 2, mask)
    return clip_fraction, approx_kl


def _masked_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ratio, log_ratio)`` with ``log_ratio = logp - old_logp`` on action tokens and 0 (ratio 1) elsewhere."""
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    return torch.exp(log_ratio), log_ratio


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip: float,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO clipped surrogate (DS-Chat ``actor_loss_fn``); all inputs ``[B, L]``, returns a scalar loss.

    ``ratio = exp(logp - old_logp)``;
    ``loss = token_mean(max(-A * ratio, -A * clamp(ratio, 1 - clip, 1 + clip)))`` over the action mask
    (global token mean over the batch, as DS-Chat). Gradients flow through ``logprobs`` only.
    """
    _check_shapes(
        "logprobs", logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, action_mask=action_mask
    )
    m = action_mask.bool()
    ratio, log_ratio = _masked_ratio(logprobs, old_logprobs, m)
    adv = torch.where(m, advantages, torch.zeros_like(advantages)).detach()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip, 1.0 + clip)
    loss = masked_mean(torch.maximum(unclipped, clipped), m)
    clip_fraction, approx_kl = _clip_stats(ratio, adv, log_ratio, m, clip)
    return loss, PolicyLossStats(clip_fraction=clip_fraction, approx_kl=approx_kl)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor, *, clip: float
) -> torch.Tensor:
    """Clipped value loss (DS-Chat ``critic_loss_fn``); inputs ``[B, L]``, returns a scalar.

    ``V_clip = clamp(V, V_old - clip, V_old + clip)``;
    ``loss = 0.5 * token_mean(max((V - R)^2, (V_clip - R)^2))`` over the action mask.
    """
    _check_shapes("values", values=values, old_values=old_values, returns=returns, action_mask=action_mask)
    m = action_mask.bool()
    old = old_values.detach()
    target = returns.detach()
    v_clipped = old + (values - old).clamp(-clip, clip)
    err = torch.maximum((values - target) ** 2, (v_clipped - target) ** 2)
    return 0.5 * masked_mean(err, m)


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, *, eps: float = GRPO_EPS, scale_by_std: bool = True
) -> torch.Tensor:
    """Group-relative advantages ``[B]`` for ``B = n_prompts * group_size`` rewards.

    Rows ``[k * group_size, (k + 1) * group_size)`` are samples of the same prompt. Within a group
    ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with the *unbiased* std (TRL's ``torch.std``); with
    ``scale_by_std=False`` just ``r_i - mean(r)``. A group whose rewards are all equal gets exact zeros.
    Raises ``ValueError`` for ``group_size < 2`` or a length that is not a multiple of it.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a 1-D [B] tensor, got shape {tuple(rewards.shape)}")
    if group_size < 2 or rewards.shape[0] % group_size != 0:
        raise ValueError(f"group_size: {group_size} must be >= 2 and divide B = {rewards.shape[0]}")
    groups = rewards.view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    adv = centered / (groups.std(dim=1, keepdim=True) + eps) if scale_by_std else centered
    equal = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    return torch.where(equal, torch.zeros_like(adv), adv).reshape(-1)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip: float,
    kl_coef: float,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """GRPO loss (TRL ``GRPOTrainer``, ``loss_type="grpo"``); per-token inputs ``[B, L]``, advantages ``[B]``.

    Per action token, with the sequence advantage ``A_b`` broadcast over its tokens::

        ratio = exp(logp - old_logp)
        d     = ref_logp - logp
        l_t   = -min(ratio * A_b, clamp(ratio, 1 - clip, 1 + clip) * A_b) + kl_coef * (exp(d) - d - 1)

    Normalization: ``loss = mean_b( sum_t l_t * mask / max(count_b, 1) )`` -- a per-sequence token mean, then a
    plain mean over *all* B sequences (an all-zero row contributes 0 but still counts in B, as in TRL).
    """
    _check_shapes(
        "logprobs", logprobs=logprobs, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, action_mask=action_mask
    )
    if tuple(advantages.shape) != (logprobs.shape[0],):
        raise ValueError(f"advantages: shape {tuple(advantages.shape)} does not match expected ({logprobs.shape[0]},)")
    m = action_mask.bool()
    ratio, log_ratio = _masked_ratio(logprobs, old_logprobs, m)
    adv = advantages.detach().to(ratio.dtype).unsqueeze(1).expand_as(ratio)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - clip, 1.0 + clip) * adv)
    d = torch.where(m, ref_logprobs.detach() - logprobs, torch.zeros_like(logprobs))
    k3 = torch.exp(d) - d - 1.0
    per_token = -surrogate + kl_coef * k3 if kl_coef != 0.0 else -surrogate
    loss = masked_mean(per_token, m, dim=1).mean()
    clip_fraction, approx_kl = _clip_stats(ratio, adv, log_ratio, m, clip)
    ref_kl = masked_mean(k3.detach(), m)
    return loss, PolicyLossStats(clip_fraction=clip_fraction, approx_kl=approx_kl, ref_kl=ref_kl)
