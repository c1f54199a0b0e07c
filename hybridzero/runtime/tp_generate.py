"""Tensor-parallel generation (``hybrid_engine.inference_tp_size`` = t > 1): ``engine.generate`` when t > 1.

Groups of ``t`` consecutive ranks (DeepSpeed's layout: ranks ``[k t, (k+1) t)``) generate together. One call:

1. agreement (3 small world collectives: cutting the model gathers ZeRO-3 groups over the whole world, so every
   rank of the world calls ``generate`` together): any rank's bad request raises on every rank (agreed, so the
   engine stays usable); then every rank's batch size, prompt width and generation arguments are exchanged, and
   arguments that differ within a group raise on every rank, naming the argument.
2. the joint batch (:mod:`hybridzero.runtime.tp_batch`): prompts and masks all-gathered in the group and
   left-padded to the widest; ``max_length`` / ``min_length`` become ``max_new_tokens`` / ``min_new_tokens`` of each
   rank's own prompt, so they mean what they mean for that rank alone.
3. the model in tensor-parallel form (:class:`~hybridzero.runtime.tp_swap.TensorParallelSwap`), HF ``generate``
   on the joint batch, two all-reduces per layer and forward in the group (ledger group ``"tp"``). Every rank of the
   group computes bit-identical logits (identical inputs, whole embeddings / norms / lm_head, and an all-reduce
   returns the same bytes to every rank), so greedy choices, EOS stops and the number of forwards agree without any
   further synchronization. A caller's ``logits_processor`` runs on its own rows only
   (:class:`~hybridzero.runtime.tp_batch.OwnRowsProcessor`, one all-gather per step); HF's own sampling
   (``do_sample``) draws from a seed the group's first rank broadcasts, inside a forked RNG.
4. each rank takes back its own rows at its own width and length (:func:`~hybridzero.runtime.tp_batch.own_rows`).

Not supported (refused by name, on every rank of the group): beam search, ``num_return_sequences`` > 1,
``return_dict_in_generate``, ``stopping_criteria``, ``streamer``, ``prefix_allowed_tokens_fn``, assisted decoding,
``inputs_embeds``, a ``max_gathered_bytes`` budget. An exception while decoding is fatal to the process group (the
peers wait in the group's all-reduces): the engine's failure guard turns it into ``PeerFailure`` on every peer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from transformers import LogitsProcessorList

from hybridzero.comm.collectives import Comm
from hybridzero.runtime.tp_batch import OwnRowsProcessor, default_attention_mask, join_rows, own_rows, pad_left
from hybridzero.runtime.tp_plans import family_of
from hybridzero.runtime.tp_swap import TensorParallelSwap, TPStats
from hybridzero.zero.coordinator import ZeroCoordinator

_REFUSED = (
    "stopping_criteria",
    "streamer",
    "prefix_allowed_tokens_fn",
    "assistant_model",
    "inputs_embeds",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
)
_OWN = ("input_ids", "attention_mask", "logits_processor", "synced_gpus")  # per rank; everything else must agree


def tp_groups(world_size: int, tp: int) -> list[list[int]]:
    """Blocks of ``tp`` consecutive ranks (pure); the config already checked that ``tp`` divides the world."""
    return [list(range(start, start + tp)) for start in range(0, world_size, tp)]


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _describe(value: Any) -> str:
    to_dict = getattr(value, "to_dict", None)
    return repr(to_dict() if callable(to_dict) else value)


def request_problem(kwargs: dict[str, Any], max_gathered_bytes: int | None, tp: int) -> str | None:
    """Why this rank's request cannot run tensor-parallel (``None`` if it can; pure)."""
    where = f"with hybrid_engine.inference_tp_size = {tp}"
    for name in _REFUSED:
        if kwargs.get(name) is not None:
            return f"generate({name}=...) is not supported {where}"
    if max_gathered_bytes is not None:
        return f"generate(max_gathered_bytes=...) is not supported {where}: the model is already split 1/{tp}"
    for name, limit in (("num_beams", 1), ("num_return_sequences", 1)):
        if int(kwargs.get(name) or 1) > limit:
            return f"generate({name}={kwargs[name]}) is not supported {where}; use {limit}"
    if kwargs.get("return_dict_in_generate"):
        return f"generate(return_dict_in_generate=True) is not supported {where}; it returns the token tensor"
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and name not in _OWN:
            return f"generate({name}=<tensor>) is not supported {where}; pass input_ids and attention_mask"
    return None


class TensorParallelGenerator:
    """The engine's tensor-parallel generation: its group's :class:`Comm` and the last call's :class:`TPStats`."""

    def __init__(self, comm: Comm, tp: int, layers_per_gather: int) -> None:
        self.tp = tp
        self.layers_per_gather = layers_per_gather
        self.world = comm  # the ZeRO-3 gathers while cutting are world collectives: agreement is world-wide
        self.comm = comm.split(tp_groups(comm.world_size, tp), name="tp")  # every rank of the world calls this
        self.last_stats: TPStats | None = None

    def generate(
        self, coordinator: ZeroCoordinator, *args: Any, max_gathered_bytes: int | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """HF ``generate`` over the group's joint batch; returns this rank's rows (see module docstring)."""
        tp = self.comm
        module: Any = coordinator.module
        ids = kwargs.pop("input_ids", None) if not args else args[0]
        problem = request_problem(kwargs, max_gathered_bytes, self.tp)
        if len(args) > 1:
            problem = f"generate takes input_ids as its only positional argument with inference_tp_size = {self.tp}"
        if problem is None and (not isinstance(ids, torch.Tensor) or ids.dim() != 2):
            problem = "generate needs input_ids as a [batch, length] tensor"
        family = None
        if problem is None:
            try:
                family = family_of(module, self.tp)
            except ValueError as exc:
                problem = str(exc)
        self.world.agree(ValueError(problem) if problem else None, "tensor-parallel generate", phase="generate")
        assert family is not None and isinstance(ids, torch.Tensor)
        config = kwargs.get("generation_config") or module.generation_config  # passed on; compared via to_dict
        eos = _eos_list(kwargs.get("eos_token_id", config.eos_token_id))
        pad = kwargs.get("pad_token_id", config.pad_token_id)
        mask = kwargs.pop("attention_mask", None)
        mask = default_attention_mask(ids, pad, eos) if mask is None else mask
        self._own_lengths(kwargs, config, ids.shape[1])
        processors = kwargs.pop("logits_processor", None)
        kwargs.pop("synced_gpus", None)
        shared = {k: _describe(v) for k, v in sorted(kwargs.items())}
        meta = (ids.shape[0], ids.shape[1], shared, processors is not None)
        everyone = self.world.all_gather_object(meta, phase="generate")
        first = self.world.rank - tp.rank
        self.world.agree(_mismatch(everyone, self.tp), "tensor-parallel generate", phase="generate")
        metas = everyone[first : first + self.tp]
        sizes = [m[0] for m in metas]
        width = max(m[1] for m in metas)
        joint_ids, joint_mask = self._joint(ids, mask, sizes, width, 0 if pad is None else int(pad))
        if any(m[3] for m in metas):
            own = None if processors is None else LogitsProcessorList(list(processors))
            kwargs["logits_processor"] = LogitsProcessorList([OwnRowsProcessor(own, tp, sizes, width, ids.shape[1])])
        do_sample = bool(kwargs.get("do_sample", config.do_sample))
        swap = TensorParallelSwap(coordinator, tp, family, self.layers_per_gather)
        with self._sampling_rng(do_sample, ids.device), swap.swapped() as stats:
            out = module.generate(joint_ids, attention_mask=joint_mask, synced_gpus=False, **kwargs)
        self.last_stats = stats
        lo = sum(sizes[: tp.rank])
        return own_rows(out, lo, lo + ids.shape[0], width, ids.shape[1], eos)

    @staticmethod
    def _own_lengths(kwargs: dict[str, Any], config: Any, width: int) -> None:
        """``max_length`` / ``min_length`` (which count this rank's prompt) as new-token counts, in place."""
        max_length = kwargs.pop("max_length", None)
        if kwargs.get("max_new_tokens") is None:
            if max_length is None and config.max_new_tokens is not None:
                kwargs["max_new_tokens"] = config.max_new_tokens
            else:
                kwargs["max_new_tokens"] = max(0, int(max_length or config.max_length) - width)
        min_length = kwargs.pop("min_length", None)
        if min_length is not None and kwargs.get("min_new_tokens") is None:
            kwargs["min_new_tokens"] = max(0, int(min_length) - width)

    def _joint(
        self, ids: torch.Tensor, mask: torch.Tensor, sizes: list[int], width: int, pad: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's prompts and masks, left-padded to ``width``, in group-rank order (one all-gather)."""
        bmax = max(sizes)
        both = torch.stack([pad_left(ids.long(), width, bmax, pad), pad_left(mask.long(), width, bmax, 0)])
        recv = torch.empty((len(sizes) * 2, bmax, width), dtype=torch.long, device=ids.device)
        self.comm.all_gather(recv, both, phase="generate", label="tp_prompts")
        recv = recv.view(len(sizes), 2, bmax, width)
        joint_ids = join_rows(recv[:, 0].reshape(-1, width), sizes)
        joint_mask = join_rows(recv[:, 1].reshape(-1, width), sizes)
        return joint_ids.to(ids.dtype), joint_mask.to(mask.dtype)

    def _sampling_rng(self, do_sample: bool, device: torch.device) -> AbstractContextManager[Any]:
        """HF's sampling draws the same numbers on every rank of the group: a seed from the group's first rank."""
        if not do_sample:
            return nullcontext()
        seed = torch.zeros(1, dtype=torch.long)
        if self.comm.rank == 0:
            seed = torch.randint(0, 2**62, (1,), dtype=torch.long)
        seed = seed.to(device)
        self.comm.broadcast(seed, 0, phase="generate")
        return _seeded(int(seed.item()), [device.index or 0] if device.type == "cuda" else [])


@contextmanager
def _seeded(seed: int, devices: list[int]) -> Iterator[None]:
    """The block draws from ``seed``; the caller's RNG state is restored afterwards."""
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _mismatch(metas: list[tuple[int, int, dict[str, str], bool]], tp: int) -> ValueError | None:
    """Generation arguments must be the same on every rank of a group (they drive one joint decode); pure, so every
    rank of the world finds the same answer from the same ``metas`` (global rank order)."""
    for start in range(0, len(metas), tp):
        first = metas[start][2]
        for rank in range(start + 1, start + tp):
            other = metas[rank][2]
            for key in sorted(set(first) | set(other)):
                if first.get(key) != other.get(key):
                    return ValueError(
                        f"tensor-parallel generate: argument {key!r} differs within a group (rank {start}: "
                        f"{first.get(key, '<unset>')}, rank {rank}: {other.get(key, '<unset>')}); the ranks of a "
                        "hybrid_engine.inference_tp_size group decode one joint batch and must pass the same arguments"
                    )
    return None
