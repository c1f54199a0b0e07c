"""DeepSpeed's ALST/Ulysses entry points (what Hugging Face Accelerate and Trainer call with
``ParallelismConfig(sp_backend="deepspeed", sp_size=s)``), on hybridzero's own Ulysses
(:mod:`hybridzero.runtime.sequence_parallel`).

The flow DeepSpeed defines and this module follows:

1. ``register_with_transformers(model, core_attn_implementation, sequence_parallel_size, micro_batch_size, ...)``
   forms the groups (:class:`SequenceParallelGroups`: ``s`` consecutive ranks share each sequence; the ``W / s``
   ranks with the same SP rank form the data-parallel group of the batch), switches ``model`` to Ulysses attention
   (heads exchanged for sequence with all-to-alls; :class:`~hybridzero.runtime.ulysses.UlyssesAttention`) and
   returns the groups as the ``mpu`` (Megatron-style parallel state);
2. ``deepspeed.initialize(..., mpu=groups)`` builds the engine with ``sequence_parallel_size = s`` over those
   groups (its gradient division by ``W`` is then the mean over the DP group of the SP group's sum);
3. the data loader adapter (:mod:`hybridzero.runtime.ulysses_data`) shards every batch's sequence over the group and
   the ``deepspeed.utils.groups`` getters name the groups to the loss aggregation.

State: DeepSpeed's API is process-global (``groups._get_sequence_parallel_group()`` takes no argument), so one
registration is active per process, held by :data:`REGISTRY` from ``register_with_transformers`` until
``unregister_from_transformers`` (or the engine built over it is destroyed, which gives the model its attention
back). A second registration while one is active is refused.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hybridzero import comm as dist  # deepspeed.comm's face: torch.distributed's own functions, re-exported
from hybridzero.comm.collectives import Comm
from hybridzero.comm.ledger import Ledger
from hybridzero.runtime.sequence_parallel import SequenceParallel, check_model

__all__ = [
    "REGISTRY",
    "UlyssesSPAttentionHF",
    "SequenceParallelGroups",
    "dp_groups",
    "groups_of",
    "register_with_transformers",
    "release",
    "unregister_from_transformers",
]


def dp_groups(world: int, size: int) -> list[list[int]]:
    """Data-parallel groups under SP ``size``: the ranks with the same SP rank, in SP-group order (pure)."""
    return [list(range(r, world, size)) for r in range(size)]


class SequenceParallelGroups:
    """The ``mpu`` of a Ulysses registration: the SP layout (:class:`SequenceParallel`, its Comm and ranks) and the
    data-parallel group. Every rank constructs it together (it forms process groups). Getters follow the names of
    DeepSpeed's ``parallel_state_sp`` (plus the data-parallel ones Megatron-style mpus have)."""

    def __init__(self, size: int) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "sequence parallelism needs an initialized process group: call deepspeed.init_distributed() (or "
                "torch.distributed.init_process_group) before register_with_transformers"
            )
        world = dist.get_world_size()
        if size < 2 or world % size:
            valid = ", ".join(str(d) for d in range(2, world + 1) if world % d == 0) or "none (world size 1)"
            raise ValueError(
                f"sequence_parallel_size = {size} must be > 1 and divide world_size = {world}; valid values: {valid}"
            )
        comm = Comm(Ledger())
        self.sequence_parallel = SequenceParallel(comm, size)
        self.data_parallel = comm.split(dp_groups(world, size), name="sp_dp")

    # --- DeepSpeed's parallel_state_sp names ---------------------------------------------------------------------
    def get_sequence_parallel_group(self) -> Any:
        """The torch process group of this rank's SP group."""
        return self.sequence_parallel.comm.group

    def get_sequence_parallel_world_size(self) -> int:
        return self.sequence_parallel.size

    def get_sequence_parallel_rank(self) -> int:
        return self.sequence_parallel.rank

    def get_sequence_data_parallel_group(self) -> Any:
        """All ranks (SP x DP): the group ZeRO shards and reduces over."""
        return dist.get_world_group()

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank()

    # --- the batch's data-parallel group -----------------------------------------------------------------------
    def get_data_parallel_group(self) -> Any:
        """The ranks with this rank's SP rank (one per SP group): the batch's data parallelism."""
        return self.data_parallel.group

    def get_data_parallel_world_size(self) -> int:
        return self.sequence_parallel.dp_size

    def get_data_parallel_rank(self) -> int:
        return self.sequence_parallel.dp_rank


class _Registry:
    """The one active registration of this process (see the module docstring)."""

    def __init__(self) -> None:
        self._active: SequenceParallelGroups | None = None

    @property
    def active(self) -> SequenceParallelGroups | None:
        return self._active

    def check_free(self) -> None:
        """Raise unless no registration is active."""
        if self._active is not None:
            raise RuntimeError(
                "Ulysses sequence parallelism is already registered in this process; call "
                "UlyssesSPAttentionHF.unregister_from_transformers() (or destroy its engine) before registering again"
            )

    def set(self, groups: SequenceParallelGroups) -> None:
        self.check_free()
        self._active = groups

    def clear(self) -> SequenceParallelGroups | None:
        groups, self._active = self._active, None
        return groups


REGISTRY = _Registry()


def register_with_transformers(
    model_name_or_path: Any,
    core_attn_implementation: str | None,
    sequence_parallel_size: int,
    micro_batch_size: int,
    seq_length: int | None = None,
    seq_length_is_variable: bool = True,
    disable_in_eval: bool = False,
    max_length: int | None = None,
) -> SequenceParallelGroups | None:
    """DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers``: groups formed, the model switched to Ulysses
    attention, the groups returned as the ``mpu`` (``None`` when ``sequence_parallel_size`` is 1: nothing to do).

    ``model_name_or_path`` must be the model object (a hub name or path is refused: the attention is selected on
    the model's config). ``core_attn_implementation`` (``None``: the model's) must equal the model's
    ``attn_implementation`` and be ``'sdpa'`` or ``'eager'``. ``seq_length`` (or its deprecated spelling
    ``max_length``) is only checked: a fixed length must divide by ``s`` (the data loader adapter right-pads other
    batches). ``micro_batch_size`` is accepted for DeepSpeed's signature (shapes are read from the inputs)."""
    del micro_batch_size
    if sequence_parallel_size == 1:
        return None
    model = model_name_or_path
    if not isinstance(model, nn.Module) or getattr(model, "config", None) is None:
        raise ValueError(
            f"register_with_transformers(model_name_or_path={model!r}): hybridzero needs the model object (an "
            "nn.Module with a Hugging Face config), not a name or path; load the model first and pass it"
        )
    seq_length = seq_length if seq_length is not None else max_length
    if not seq_length_is_variable:
        if seq_length is None or seq_length % sequence_parallel_size:
            raise ValueError(
                f"seq_length = {seq_length} with seq_length_is_variable = False must be a multiple of "
                f"sequence_parallel_size = {sequence_parallel_size}"
            )
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if core_attn_implementation is not None and core_attn_implementation != impl:
        raise ValueError(
            f"core_attn_implementation = {core_attn_implementation!r} does not match the model's attn_implementation "
            f"= {impl!r}; load the model with attn_implementation={core_attn_implementation!r} or pass {impl!r}"
        )
    check_model(model.config, sequence_parallel_size)
    REGISTRY.check_free()
    groups = SequenceParallelGroups(sequence_parallel_size)
    REGISTRY.set(groups)
    try:
        groups.sequence_parallel.attach(model, local_in_eval=disable_in_eval)
    except BaseException:
        REGISTRY.clear()
        raise
    return groups


def unregister_from_transformers() -> None:
    """Give the registered model its own attention back and forget the registration (idempotent)."""
    groups = REGISTRY.clear()
    if groups is not None:
        groups.sequence_parallel.detach()


def release(sequence_parallel: SequenceParallel) -> None:
    """Forget the registration whose layout is ``sequence_parallel`` (its engine was destroyed); others stay."""
    active = REGISTRY.active
    if active is not None and active.sequence_parallel is sequence_parallel:
        REGISTRY.clear()


def groups_of(mpu: Any) -> SequenceParallelGroups | None:
    """The registration ``mpu`` stands for: a :class:`SequenceParallelGroups`, or an object (the alias's
    ``parallel_state_sp`` module) whose ``active_groups()`` returns one; ``None`` for anything else."""
    if isinstance(mpu, SequenceParallelGroups):
        return mpu
    active = getattr(mpu, "active_groups", None)
    found = active() if callable(active) else None
    return found if isinstance(found, SequenceParallelGroups) else None


class UlyssesSPAttentionHF:
    """DeepSpeed's class name for the Hugging Face registration: its class methods are this module's functions.
    Instances are not provided (the attention itself is :class:`~hybridzero.runtime.ulysses.UlyssesAttention`)."""

    register_with_transformers = staticmethod(register_with_transformers)
    unregister_from_transformers = staticmethod(unregister_from_transformers)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs
        raise NotImplementedError(
            "UlyssesSPAttentionHF(...) instances are not provided by hybridzero: call "
            "UlyssesSPAttentionHF.register_with_transformers(model, ...) to switch a model to Ulysses attention"
        )
