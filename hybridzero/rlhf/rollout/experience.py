"""Typed experience records produced by a rollout and consumed by the PPO / GRPO updates.

Layout convention (DeepSpeed-Chat's, made explicit by masks instead of a ``start`` offset)::

    sequences       [B, T]    left-padded prompt (padded to the same width P) + right-padded answer
    attention_mask  [B, T]    1 on real tokens (prompt and answer), 0 on padding
    per-token data  [B, T-1]  position t describes token t+1 given tokens <= t ("shifted" space)
    action_mask     [B, T-1]  1 where token t+1 is a generated answer token; a subset of attention_mask[:, 1:]

Prompt positions, left padding and right padding are all 0 in ``action_mask``; every per-token function in
:mod:`hybridzero.rlhf.algorithms.ppo` reads only positions where ``action_mask`` is 1, so the answers of one batch may
have different lengths (and a row may have no action at all).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

_FLOAT_FIELDS: tuple[str, ...] = ("logprobs", "ref_logprobs", "values")


def _expect_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Raise ``ValueError`` naming ``name`` with the actual and expected shapes when they differ."""
    if tuple(tensor.shape) != expected:
        raise ValueError(f"Experience.{name}: shape {tuple(tensor.shape)} does not match expected {expected}")


def _is_mask_dtype(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.bool or not (tensor.is_floating_point() or tensor.is_complex())


@dataclass(frozen=True)
class Experience:
    """One rollout batch: sequences, their masks, and the per-token / per-sequence numbers of the old policy.

    Shapes (``B`` sequences of ``T`` tokens):

    * ``sequences``       ``[B, T]`` integer token ids (left-padded prompts, right-padded answers).
    * ``attention_mask``  ``[B, T]`` 1 for real tokens, 0 for padding (bool or integer).
    * ``action_mask``     ``[B, T-1]`` 1 for generated (answer) tokens, aligned with ``logprobs``
      (position t <-> token t+1); must be 0 wherever ``attention_mask[:, 1:]`` is 0.
    * ``logprobs``        ``[B, T-1]`` float, actor ``log p(token_{t+1} | tokens_{<=t})`` at generation time.
    * ``ref_logprobs``    ``[B, T-1]`` float, the same under the frozen reference model.
    * ``values``          ``[B, T-1]`` float, critic values per position (all zeros for GRPO: no critic).
    * ``rewards``         ``[B]`` float, one scalar reward-model score per sequence.

    The record is frozen; derived data (advantages, returns) live outside it. Call :meth:`validate` at the
    producer/consumer boundary.
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor

    @property
    def batch_size(self) -> int:
        """``B``: the number of sequences."""
        return int(self.sequences.shape[0])

    @property
    def num_actions(self) -> torch.Tensor:
        """``[B]`` int64: the number of generated tokens of each sequence."""
        return self.action_mask.to(torch.int64).sum(dim=1)

    def validate(self) -> Experience:
        """Check shapes, dtypes, devices and the mask invariants; return ``self`` so calls can be chained.

        Raises ``ValueError`` naming the offending field (and, for shapes, both the actual and expected shapes).
        """
        if self.sequences.dim() != 2:
            raise ValueError(
                f"Experience.sequences: expected a 2-D [B, T] tensor, got shape {tuple(self.sequences.shape)}"
            )
        if self.sequences.is_floating_point() or self.sequences.dtype == torch.bool:
            raise ValueError(f"Experience.sequences: expected integer token ids, got dtype {self.sequences.dtype}")
        b, t = (int(d) for d in self.sequences.shape)
        if t < 2:
            raise ValueError(f"Experience.sequences: need T >= 2 tokens to have any action, got shape {(b, t)}")
        _expect_shape("attention_mask", self.attention_mask, (b, t))
        _expect_shape("action_mask", self.action_mask, (b, t - 1))
        for name in _FLOAT_FIELDS:
            _expect_shape(name, getattr(self, name), (b, t - 1))
        _expect_shape("rewards", self.rewards, (b,))
        for name in ("attention_mask", "action_mask"):
            tensor = getattr(self, name)
            if not _is_mask_dtype(tensor):
                raise ValueError(f"Experience.{name}: expected a bool or integer mask, got dtype {tensor.dtype}")
        for name in (*_FLOAT_FIELDS, "rewards"):
            tensor = getattr(self, name)
            if not tensor.is_floating_point():
                raise ValueError(f"Experience.{name}: expected a floating dtype, got {tensor.dtype}")
        self._validate_devices()
        self._validate_masks()
        return self

    def _validate_devices(self) -> None:
        device = self.sequences.device
        for field in dataclasses.fields(self):
            tensor: torch.Tensor = getattr(self, field.name)
            if tensor.device != device:
                raise ValueError(f"Experience.{field.name}: on device {tensor.device}, sequences on {device}")

    def _validate_masks(self) -> None:
        for name in ("attention_mask", "action_mask"):
            tensor = getattr(self, name).to(torch.int64)
            if bool(((tensor != 0) & (tensor != 1)).any()):
                raise ValueError(f"Experience.{name}: mask values must be 0 or 1")
        outside = self.action_mask.bool() & ~self.attention_mask[:, 1:].bool()
        if bool(outside.any()):
            raise ValueError(
                "Experience.action_mask: marks positions whose token is padding "
                "(must be a subset of attention_mask[:, 1:])"
            )

    def to(self, device: torch.device | str) -> Experience:
        """A copy with every tensor moved to ``device``."""
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)}
        return Experience(**moved)
