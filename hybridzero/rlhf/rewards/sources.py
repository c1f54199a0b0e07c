"""A GRPO run's reward sources (reward functions, then optionally the reward model) and the agreement protocol.

Data path of a reward: the rollout decodes this rank's answers (text cut at a stop string, special tokens skipped),
takes their token ids (answer tokens up to and including EOS) and the prompt rows' extra columns, and
:meth:`RewardSet.score` calls every function once on the batch (:mod:`hybridzero.rlhf.rewards.functions`: isolated,
with a
deadline). The reward model's last-token score (from the experience) is one more source. Sources combine into one
reward per sample: the weighted sum over the sources that scored it.

Agreement (``reward_error_policy``):

* ``raise`` — after scoring, one all-reduce of "did anything fail here" (a function raised, hung, died, returned
  NaN/inf or a wrong length, or a sample no source scored); if any rank says yes, the ranks all-gather their first
  messages and *every* rank raises the same :class:`~hybridzero.rlhf.rewards.functions.RewardError` (the lowest failing
  rank's, naming rank, function, sample and prompt). Every rank is at the same collective when it raises: no rank
  waits on another, nothing is updated.
* ``skip`` — no extra collective: a failed or unscored sample gets reward 0 and is *skipped* (left out of its
  group's statistics, zero advantage, no loss and no count in the loss normalisers); the skipped count is a global
  metric. What a rank skips depends only on its own samples, so the ranks stay in step.

A batch's functions run one after another, so a rank can spend up to ``F × reward_timeout`` seconds scoring while
its peers wait in the next collective; :meth:`RewardSet.build` warns when that reaches the collective timeout
(``$HYBRIDZERO_TIMEOUT_S``, default 600 s): only below it does a hang end as the same error on every rank rather
than as a collective timeout (still an error on every rank, never a hang).

Isolation: with ``reward_timeout > 0`` the set owns one :class:`~hybridzero.rlhf.rewards.isolation.RewardWorker`
(a persistent child forked from this rank, holding the functions; ``None`` with ``reward_timeout = 0``, in-process).
It forks at :meth:`RewardSet.start` or, failing that, at the first :meth:`RewardSet.score`; a worker killed at the
deadline or dead is replaced at the next call. Whoever builds the set closes it (:meth:`RewardSet.close`, or
``with``): the step-3 trainer does so in a ``finally`` when the run ends, by return or by exception. The frozen
fields never change; only the worker object inside changes state.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch

from hybridzero.comm.collectives import DEFAULT_TIMEOUT_S, Comm
from hybridzero.rlhf.engines import global_sum
from hybridzero.rlhf.rewards.functions import (
    RewardCallError,
    RewardError,
    RewardFunction,
    RewardSource,
    RewardWorker,
    SpecFunction,
    combine_rewards,
    reward_sources,
)
from hybridzero.rlhf.rewards.functions import score_with_functions as _score
from hybridzero.rlhf.rewards.values import one_line
from hybridzero.rlhf.settings import GRPOSettings
from hybridzero.runtime.engine import Engine

__all__ = ["RewardSet", "Scored"]


def _lazy(fn: object) -> TypeGuard[SpecFunction]:
    return isinstance(fn, SpecFunction)


@dataclass(frozen=True)
class Scored:
    """One rank's rewards for one batch: ``rewards [B]`` float32 (0 where skipped), ``skipped [B]`` bool and
    ``per_source [S, B]`` float64 (NaN: the source did not score the sample)."""

    rewards: torch.Tensor
    skipped: torch.Tensor
    per_source: torch.Tensor


@dataclass(frozen=True)
class RewardSet:
    """The reward functions, whether the reward model scores too (and its weight), the deadline, the policy, and
    the worker the functions run in (``None``: in-process; module docstring). A context manager closing it."""

    sources: tuple[RewardSource, ...]
    with_model: bool
    model_weight: float
    timeout: float
    policy: str
    worker: RewardWorker | None = field(default=None, compare=False, repr=False)
    backstop: float = 0.0

    @classmethod
    def build(cls, s: GRPOSettings, api_funcs: Sequence[str | RewardFunction] = ()) -> RewardSet:
        """From the settings (``reward_funcs`` specs) or the Python API's functions (one of the two)."""
        if api_funcs and s.reward_funcs:
            raise ValueError(
                f"reward functions given twice: reward_funcs {s.reward_funcs} in the settings and "
                f"{len(api_funcs)} through train_step3(reward_funcs=...); give them in one place"
            )
        funcs: Sequence[str | RewardFunction] = list(api_funcs) or list(s.reward_funcs)
        with_model = s.uses_reward_model(len(api_funcs))
        isolated = s.reward_timeout > 0 and bool(funcs) and hasattr(os, "fork")
        sources, model_weight = reward_sources(funcs, s.reward_weights, with_model, lazy=isolated)
        collective_s = float(os.environ.get("HYBRIDZERO_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        if sources and len(sources) * s.reward_timeout >= 0.9 * collective_s:
            warnings.warn(
                f"reward_timeout {s.reward_timeout:g} s x {len(sources)} reward functions may keep a rank scoring "
                f"{len(sources) * s.reward_timeout:g} s while its peers wait in a collective that times out after "
                f"{collective_s:g} s (HYBRIDZERO_TIMEOUT_S): functions that hang would end the run as a collective "
                f"timeout, not a RewardError; lower --reward_timeout below {0.9 * collective_s / len(sources):g} s "
                f"or raise HYBRIDZERO_TIMEOUT_S",
                stacklevel=2,
            )
        steps = [(f"importing --reward_funcs {f.spec!r}", f.load) for f in (x.fn for x in sources) if _lazy(f)]
        worker = RewardWorker([src.fn for src in sources], steps) if isolated else None
        backstop = 0.0 if isolated or not sources else 0.5 * collective_s / len(sources)
        return cls(tuple(sources), with_model, model_weight, s.reward_timeout, s.reward_error_policy, worker, backstop)

    def start(self, comm: Comm | None = None) -> None:
        """Fork the worker now, importing the reward modules in it under the deadline (no-op without a worker, or
        when it runs), and agree on the outcome over ``comm``: a module that raises or hangs at import is the same
        one-line :class:`RewardError` on every rank (the lowest failing rank's). Cheap while this process is
        small: a worker forked after the engines exist keeps, copy-on-write, every page the trainer rewrites."""
        error: str | None = None
        if self.worker is not None:
            try:
                self.worker.start(self.timeout)
            except (RewardCallError, OSError) as exc:
                error = str(exc) if isinstance(exc, RewardCallError) else f"could not start the reward worker: {exc}"
        messages = [error] if comm is None else comm.all_gather_object(error, phase="rewards")
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        if failed:
            self.close()
            rank, first = failed[0]
            raise RewardError(f"rank {rank if comm is not None else 0}: {first}")

    def close(self) -> None:
        """End the worker process, if any (idempotent; a later :meth:`score` would fork a fresh one)."""
        if self.worker is not None:
            self.worker.close()

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def names(self) -> list[str]:
        """Display names of the sources, in order (``reward_model`` last when it scores)."""
        return [src.name for src in self.sources] + (["reward_model"] if self.with_model else [])

    def score(
        self,
        engine: Engine,
        prompts: list[str],
        completions: list[str],
        completion_ids: list[list[int]],
        columns: dict[str, list[Any]],
        model_scores: torch.Tensor,
    ) -> Scored:
        """Score a batch (module docstring); raises the same :class:`RewardError` on every rank under ``raise``."""
        funcs = _score(
            self.sources,
            prompts,
            completions,
            completion_ids,
            columns,
            timeout=self.timeout,
            worker=self.worker,
            backstop=self.backstop,
        )
        parts = [funcs.values]
        weights = [src.weight for src in self.sources]
        if self.with_model:
            parts.append(model_scores.detach().double().cpu()[None])
            weights.append(self.model_weight)
        values = torch.cat(parts) if parts else funcs.values
        total = combine_rewards(values, torch.tensor(weights, dtype=torch.float64))
        unscored = torch.isnan(total) & ~funcs.failed
        error = funcs.error
        if error is None and bool(unscored.any()):
            i = int(unscored.nonzero()[0])
            error = f"no reward source scored sample {i} of {len(prompts)} (prompt {prompts[i][:80]!r}): all None"
        if self.policy == "raise":
            self._agree(engine, error, self.names)
        skipped = funcs.failed | torch.isnan(total)
        rewards = torch.where(skipped, torch.zeros_like(total), total).float()
        return Scored(rewards, skipped, values)

    @staticmethod
    def _agree(engine: Engine, error: str | None, names: list[str]) -> None:
        """Raise the lowest failing rank's message on every rank when any rank has one (one all-reduce when none
        does; an all-gather of the messages when one does). A peer that never reaches the agreement (its process
        killed, e.g. by a reward function killing its trainer) makes the collective fail here: that becomes a
        one-line :class:`RewardError` naming the functions just called, this rank and, at world 2, the peer."""
        try:
            (failing,) = global_sum(engine, [0.0 if error is None else 1.0])
            if failing == 0:
                return
            messages = engine.comm.all_gather_object(error, phase="rewards")
        except Exception as exc:  # noqa: BLE001 -- a transport error naming no function becomes one that does
            rank, world = engine.comm.rank, engine.comm.world_size
            peer = f"rank {1 - rank}" if world == 2 else "a peer rank"
            raise RewardError(
                f"rank {rank}: {peer} left during the reward agreement after calling reward functions {names} "
                f"(its process died or was killed, e.g. by a reward function killing its trainer; "
                f"{error or 'no function failed here'}): {one_line(str(exc), 200)}"
            ) from exc
        rank, first = next((r, m) for r, m in enumerate(messages) if m is not None)
        raise RewardError(f"rank {rank}: {first} (reward_error_policy=raise; 'skip' would skip such samples)")
