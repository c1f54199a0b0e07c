"""The rollout-engine interface (DESIGN §5): what the RL trainers need from whatever generates their answers.

An engine is built once per rank, then: :meth:`~RolloutEngine.start` (before the first rollout),
:meth:`~RolloutEngine.sync_weights` (from the actor's shards, bucket by bucket, counted in the ledger; a no-op for
the ``hf`` engine, which generates on the shards themselves), :meth:`~RolloutEngine.generate` (prompt token ids
in, answer token ids out, with the sampler's per-token log-probs where the engine has them), optionally
:meth:`~RolloutEngine.sleep` / :meth:`~RolloutEngine.wake` around training (free the engine's memory), and
:meth:`~RolloutEngine.stop`. The trainer always recomputes the log-probs it trains on; the sampler's are used only by
the truncated importance-sampling correction (:mod:`.importance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hybridzero.runtime.engine import Engine

__all__ = [
    "ROLLOUT_ENGINES",
    "Generations",
    "RolloutEngine",
    "RolloutEngineError",
    "SamplingSpec",
    "SyncStats",
    "check_rollout_engine",
]

ROLLOUT_ENGINES = ("hf", "vllm")


class RolloutEngineError(RuntimeError):
    """The rollout engine cannot start, run or take weights; the message is one line and says what to do."""


def check_rollout_engine(name: str, where: str) -> str:
    """``name`` if it is a known engine, else a one-line ``ValueError`` naming ``where`` and the valid values."""
    if name not in ROLLOUT_ENGINES:
        raise ValueError(f"{where} = {name!r} is not a rollout engine; valid: {', '.join(ROLLOUT_ENGINES)}")
    return name


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample: ``seeds`` one per prompt (``None``: greedy), ``temperature``, ``top_k`` (0: off),
    ``max_new_tokens``, ``eos_id`` (generation stops after it; ``None``: runs to ``max_new_tokens``)."""

    max_new_tokens: int
    eos_id: int | None
    seeds: Sequence[int] | None = None
    temperature: float = 1.0
    top_k: int = 0


@dataclass(frozen=True)
class Generations:
    """Per prompt: the answer's token ids (EOS included when it was sampled) and, where the engine reports them,
    the sampler's log-probability of each of those tokens (same lengths)."""

    tokens: list[list[int]]
    logprobs: list[list[float]] | None = None


@dataclass
class SyncStats:
    """What weight syncs cost so far: count, seconds, tensors and bytes loaded, groups gathered."""

    syncs: int = 0
    seconds: float = 0.0
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    history: list[float] = field(default_factory=list)


class RolloutEngine(Protocol):
    """See the module docstring. Every method may issue collectives only where it says so."""

    name: str

    def start(self) -> None:
        """Build the engine (idempotent)."""

    def stop(self) -> None:
        """Free the engine and everything it started (idempotent; also after a failure)."""

    def sync_weights(self, actor: Engine) -> SyncStats:
        """Load the actor's current full weights; collective over the actor's ranks (ZeRO-3 gathers)."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec) -> Generations:
        """Answers for ``prompts`` (unpadded token ids) on this rank; no collectives."""

    def sleep(self) -> None:
        """Release the engine's memory until :meth:`wake` (a no-op where the platform has no sleep mode)."""

    def wake(self) -> None:
        """Undo :meth:`sleep`."""
