"""Pure math of the GRPO family: advantages, overlong shaping, the clipped policy loss, loss aggregation.

Conventions of :mod:`hybridzero.rlhf.algorithms.ppo` hold (shifted ``[B, L]`` per-token tensors, ``torch.where``
masking,
no ``backward``, coefficients keyword-only). Rewards are ``[B]`` with the ``G`` samples of a prompt contiguous;
``NaN`` marks a *skipped* sample (no reward): it is left out of its group's statistics and gets advantage 0.

The variants (``--algorithm`` presets in :mod:`hybridzero.rlhf.settings`):

* **GRPO** — Shao et al. 2024, *DeepSeekMath*, arXiv:2402.03300, eq. (3): group-normalised advantage
  ``A_i = (r_i - mean(r)) / std(r)`` broadcast over the answer's tokens, PPO clipped ratio per token, the k3 estimate
  of ``KL(pi || pi_ref)`` (eq. (4): ``pi_ref/pi - log(pi_ref/pi) - 1``) with coefficient beta, and
  ``1/G sum_i 1/|o_i| sum_t`` (``loss_type="grpo"``).
* **Dr. GRPO** — Liu et al. 2025, *Understanding R1-Zero-Like Training*, arXiv:2503.20783, §3.2 eq. (3)-(4): no
  ``std`` division (``scale_rewards="none"``) and no ``1/|o_i|``: a token sum divided by a constant
  (``loss_type="dr_grpo"``: ``B x max_completion_length``).
* **DAPO** — Yu et al. 2025, arXiv:2503.14476, eq. (8)-(13): clip-higher (``eps_low`` < ``eps_high``), a token-level
  mean over all tokens of the batch (``loss_type="dapo"``), dynamic sampling (groups whose rewards are all equal are
  regenerated: :func:`degenerate_groups`) and soft overlong punishment (eq. (13), :func:`overlong_penalty`).
* **GSPO** — Zheng et al. 2025, *Group Sequence Policy Optimization*, arXiv:2507.18071, eq. (5)-(7): the importance
  ratio is the sequence's length-normalised one, ``s_i = exp(1/|y_i| sum_t log(pi/pi_old))``, clipped per sequence
  (``importance_sampling_level="sequence"``).
* **RLOO** — Ahmadian et al. 2024, *Back to Basics*, arXiv:2402.14740, §3.3 eq. (9) (Kool et al. 2019): the
  leave-one-out baseline ``A_i = r_i - 1/(G-1) sum_{j != i} r_j`` (``baseline="leave_one_out"``), no std scaling, and
  the REINFORCE token sum (``loss_type="dr_grpo"``: the sum of the answer's log-probs, over a constant).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridzero.rlhf.algorithms.ppo import GRPO_EPS, masked_mean

__all__ = [
    "ClippedLoss",
    "aggregate_loss",
    "batch_std",
    "clipped_policy_loss",
    "degenerate_groups",
    "group_advantages",
    "overlong_penalty",
]


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a 1-D [B] tensor, got shape {tuple(rewards.shape)}")
    if group_size < 2 or rewards.shape[0] % group_size != 0:
        raise ValueError(f"group_size: {group_size} must be >= 2 and divide B = {rewards.shape[0]}")
    return rewards.view(-1, group_size)


def degenerate_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B / G]`` bool: groups that carry no signal — all their scored rewards equal, or fewer than 2 scored."""
    g = _groups(rewards, group_size)
    valid = ~torch.isnan(g)
    first = torch.where(valid, g, torch.full_like(g, float("inf"))).min(dim=1, keepdim=True).values
    same = torch.where(valid, g == first, torch.ones_like(valid)).all(dim=1)
    return same | (valid.sum(dim=1) < 2)


def batch_std(count: float, total: float, total_sq: float) -> float:
    """Unbiased std of a batch from its (global) count, sum and sum of squares; 0 below 2 samples."""
    if count < 2:
        return 0.0
    var = (total_sq - total * total / count) / (count - 1)
    return max(var, 0.0) ** 0.5


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    baseline: str,
    scale: str,
    batch_scale: float | None = None,
    eps: float = GRPO_EPS,
) -> torch.Tensor:
    """``[B]`` advantages from ``[B]`` rewards (NaN: skipped sample), groups of ``group_size`` contiguous rows.

    Over a group's scored samples (``n`` of them, mean ``m``):

    * ``baseline="group_mean"``: ``A_i = r_i - m`` (GRPO eq. (3) numerator);
    * ``baseline="leave_one_out"``: ``A_i = r_i - (sum_j r_j - r_i) / (n - 1) = n / (n - 1) (r_i - m)`` (RLOO);
    * ``scale="group"``: divided by the group's unbiased std ``+ eps``; ``"batch"``: by ``batch_scale + eps``
      (the global batch's std, :func:`batch_std`); ``"none"``: not divided (Dr. GRPO).

    Skipped samples, and every sample of a :func:`degenerate_groups` group, get exactly 0.
    """
    g = _groups(rewards, group_size)
    valid = ~torch.isnan(g)
    n = valid.sum(dim=1, keepdim=True).to(g.dtype)
    r = torch.where(valid, g, torch.zeros_like(g))
    mean = r.sum(dim=1, keepdim=True) / n.clamp(min=1)
    adv = torch.where(valid, r - mean, torch.zeros_like(r))
    if baseline == "leave_one_out":
        adv = adv * n / (n - 1).clamp(min=1)
    elif baseline != "group_mean":
        raise ValueError(f"baseline {baseline!r}: expected 'group_mean' or 'leave_one_out'")
    if scale == "group":
        var = torch.where(valid, (r - mean) ** 2, torch.zeros_like(r)).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
        adv = adv / (var.sqrt() + eps)
    elif scale == "batch":
        if batch_scale is None:
            raise ValueError("scale='batch' needs batch_scale (the global batch's reward std)")
        adv = adv / (batch_scale + eps)
    elif scale != "none":
        raise ValueError(f"scale {scale!r}: expected 'group', 'batch' or 'none'")
    dead = degenerate_groups(rewards, group_size)[:, None] | ~valid
    return torch.where(dead, torch.zeros_like(adv), adv).reshape(-1)


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO eq. (13), soft overlong punishment, added to the reward of each answer of ``lengths`` tokens::

        0                                      if |y| <= L_max - L_cache
        penalty * ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
        -penalty                               if |y| > L_max

    with ``L_max = max_len`` and ``L_cache = buffer`` (``buffer = 0``: all zeros)."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    free = max_len - buffer
    over = (free - lengths.float()) / buffer
    shaped = torch.where(lengths > free, over, torch.zeros_like(over))
    return penalty * torch.where(lengths > max_len, torch.full_like(shaped, -1.0), shaped)


@dataclass(frozen=True)
class ClippedLoss:
    """``per_token [B, L]`` loss (0 off the mask) and detached token-mean stats: ``clip_fraction`` (share of
    tokens on the active clipped branch), ``approx_kl`` (``0.5 mean (logp - old)^2``) and ``ref_kl`` (mean k3)."""

    per_token: torch.Tensor
    clip_fraction: torch.Tensor
    approx_kl: torch.Tensor
    ref_kl: torch.Tensor


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    level: str,
    beta: float,
) -> ClippedLoss:
    """Per-token GRPO-family loss ``l_t = -min(w A, clamp(w, 1 - eps_low, 1 + eps_high) A) + beta k3_t``.

    ``level="token"``: ``w_t = exp(logp_t - old_t)`` (GRPO, DAPO's clip-higher with ``eps_high > eps_low``);
    ``level="sequence"``: ``w_t = s_i = exp(mean_t (logp_t - old_t))`` for every token of answer ``i`` (GSPO eq. (7)),
    so the whole answer is clipped together. ``k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1`` (only when
    ``beta != 0``; ``ref_logprobs`` may then be ``None``). ``advantages`` is ``[B]``, broadcast over tokens, or
    ``[B, T]`` per token.
    """
    m = mask.bool()
    log_ratio = torch.where(m, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    if level == "sequence":
        seq = log_ratio.sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
        log_w = seq.expand_as(log_ratio)
    elif level == "token":
        log_w = log_ratio
    else:
        raise ValueError(f"importance_sampling_level {level!r}: expected 'token' or 'sequence'")
    w = torch.exp(log_w)
    adv = advantages.detach().to(w.dtype)
    adv = adv[:, None].expand_as(w) if adv.dim() == 1 else adv  # [B, T]: per-token (IS-weighted) advantages
    per_token = -torch.minimum(w * adv, w.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
    k3 = torch.zeros_like(per_token)
    if beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("beta != 0 needs the reference log-probabilities")
        d = torch.where(m, ref_logprobs.detach() - logprobs, torch.zeros_like(logprobs))
        k3 = torch.exp(d) - d - 1.0
        per_token = per_token + beta * k3
    with torch.no_grad():
        clipped = ((w > 1.0 + eps_high) & (adv > 0)) | ((w < 1.0 - eps_low) & (adv < 0))
        stats = (masked_mean(clipped.to(w.dtype), m), 0.5 * masked_mean(log_ratio.detach() ** 2, m))
    per_token = torch.where(m, per_token, torch.zeros_like(per_token))
    return ClippedLoss(per_token, stats[0], stats[1], masked_mean(k3.detach(), m))


def aggregate_loss(
    per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, *, num_seqs: float, num_tokens: float, max_len: int
) -> torch.Tensor:
    """This rank's share of the mini-batch loss; the shares of all ranks *sum* to the global loss.

    ``num_seqs`` / ``num_tokens`` are the *global* counts of the mini-batch's (non-skipped) answers and answer
    tokens (each clamped to >= 1), so the result does not depend on how the batch is split over ranks:

    * ``"grpo"``: ``sum_i (sum_t l_it / |o_i|) / num_seqs`` (per-answer token mean, then mean over answers);
    * ``"dapo"``: ``sum_it l_it / num_tokens`` (one token-level mean over the batch, DAPO eq. (8));
    * ``"dr_grpo"``: ``sum_it l_it / (num_seqs * max_len)`` (a constant normaliser, Dr. GRPO).
    """
    m = mask.bool()
    total = torch.where(m, per_token, torch.zeros_like(per_token))
    if loss_type == "grpo":
        per_seq = total.sum(dim=1) / m.sum(dim=1).clamp(min=1).to(total.dtype)
        return per_seq.sum() / max(num_seqs, 1.0)
    if loss_type == "dapo":
        return total.sum() / max(num_tokens, 1.0)
    if loss_type == "dr_grpo":
        return total.sum() / (max(num_seqs, 1.0) * max_len)
    raise ValueError(f"loss_type {loss_type!r}: expected 'grpo', 'dapo' or 'dr_grpo'")
