"""Dealing data to ranks so that a **global** batch has the same samples at every world size.

An epoch's order is one seeded permutation of the whole dataset (the same on every rank), cut into global
batches; rank ``r`` takes the ``r``-th contiguous slice of each (steps 1 and 2, the ptx stream).

Step 3 (:class:`Plan`, :func:`rank_prompts`): an iteration consumes ``generation_batches`` global generation
batches of ``P_g = per_device_generation_batch_size / k x W`` prompts (``k`` = samples per prompt: 1 for PPO,
``group_size`` for GRPO) from a seeded per-epoch order. A global batch is cut into training chunks of
``u x W`` prompts (``u = per_device_training_batch_size / k``) and rank ``r`` takes slice ``r`` of every chunk; so
the ``j``-th training mini-batch of every rank is slice ``r`` of global chunk ``j``, and the union over ranks is the
same set of samples at every world size. Sample ``j`` of the prompt at epoch position ``q`` has the id
``(epoch x n_prompts + q) x k + j`` (its sampling seed; see :mod:`hybridzero.rlhf.rollout.generate`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from hybridzero.rlhf.settings import GRPOSettings, PPOSettings

__all__ = ["Plan", "epoch_order", "make_plan", "rank_prompts", "rank_slice", "steps_per_epoch"]


def steps_per_epoch(n_items: int, global_batch: int, what: str) -> int:
    """Whole global batches in an epoch; raises naming ``what`` when the data cannot fill even one."""
    if n_items < global_batch:
        raise ValueError(
            f"{what}: {n_items} record(s) cannot fill one global batch of {global_batch} "
            "(per-device batch x world size x accumulation); lower the batch size or add data"
        )
    return n_items // global_batch


def epoch_order(n_items: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The epoch's global order of item indices (same on every rank)."""
    order = list(range(n_items))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def rank_slice(global_indices: Sequence[int], rank: int, world: int) -> list[int]:
    """Rank ``rank``'s contiguous share of one global batch (``len`` divisible by ``world``)."""
    if len(global_indices) % world:
        raise ValueError(f"a global batch of {len(global_indices)} does not split over {world} ranks")
    per = len(global_indices) // world
    return list(global_indices[rank * per : (rank + 1) * per])


@dataclass(frozen=True)
class Plan:
    """Iteration arithmetic of a step-3 run (per rank unless named global)."""

    world: int
    k: int  # samples per prompt
    prompts_per_gen_batch: int  # per rank
    prompts_per_train_batch: int  # per rank (u)
    global_prompts_per_iteration: int
    iterations_per_epoch: int
    total_iterations: int
    n_prompts: int
    schedule_iterations: int = 0  # the lr schedule's horizon (DeepSpeed-Chat's: test mode does not shorten it)

    def sample_ids(self, positions: Sequence[int], epoch: int) -> list[int]:
        """Sampling ids of the ``k`` samples of each prompt at epoch ``positions`` (module docstring)."""
        return [(epoch * self.n_prompts + q) * self.k + j for q in positions for j in range(self.k)]


def make_plan(s: PPOSettings, world: int, n_prompts: int) -> Plan:
    """The run's :class:`Plan`; raises naming the sizes when the prompts cannot fill one iteration."""
    k = s.group_size if isinstance(s, GRPOSettings) else 1
    per_gen = s.per_device_generation_batch_size // k
    per_iter = per_gen * world * s.generation_batches
    if n_prompts < per_iter:
        raise ValueError(
            f"step 3 has {n_prompts} usable prompt(s) but one iteration needs {per_iter} "
            f"(per_device_generation_batch_size {s.per_device_generation_batch_size} / {k} sample(s) "
            f"per prompt x world {world} x generation_batches {s.generation_batches})"
        )
    per_epoch = n_prompts // per_iter
    total = per_epoch * s.num_train_epochs
    if s.max_steps is not None:
        total = min(total, s.max_steps)
    horizon = total
    if s.enable_test_mode:  # DeepSpeed-Chat stops after test_stop_step generation batches, else after one epoch
        wanted = -(-s.test_stop_step // s.generation_batches) if s.test_stop_step else per_epoch
        total = min(total, wanted)
    return Plan(
        world, k, per_gen, s.per_device_training_batch_size // k, per_iter, per_epoch, total, n_prompts, horizon
    )


def rank_prompts(order: list[int], plan: Plan, iteration_in_epoch: int, batch: int, rank: int) -> list[int]:
    """Epoch positions of rank ``rank``'s prompts in generation batch ``batch`` of an iteration (module doc)."""
    size = plan.prompts_per_gen_batch * plan.world
    start = (iteration_in_epoch * (plan.global_prompts_per_iteration // size) + batch) * size
    chunk, u = plan.prompts_per_train_batch * plan.world, plan.prompts_per_train_batch
    out: list[int] = []
    for c in range(start, start + size, chunk):
        out += list(range(c + rank * u, c + (rank + 1) * u))
    return out
