"""``zero.Init``: models built inside it are never whole on one rank.

DeepSpeed partitions inside ``zero.Init`` by replacing torch's tensor constructors and every ``nn.Module``
subclass's ``__init__`` for the duration of the block. We replace nothing. Two public torch mechanisms suffice:

* **When to partition** — torch's global module-registration hooks (``register_module_module_registration_hook``,
  ``register_module_parameter_registration_hook``), installed on entry and removed on exit through their handles.
  A submodule is assigned to its parent only after its own constructor returned, so at that moment its parameters
  (those nobody owns yet) are partitioned: each rank keeps its slice in the context's :class:`InitStore` and the
  parameter's data becomes a size-0 placeholder (DeepSpeed's). Parameters registered directly on the
  top-level module are partitioned on exit. Construction itself (and its RNG use) is untouched, hence eager-exact.
* **Writes after partitioning** — a :class:`torch.overrides.TorchFunctionMode` active inside the block sees every
  torch call (``normal_``, ``nn.init.*``, ``fill_``, ``copy_``, ``p.data``, ``p.data[i].zero_()``...). Before a call
  runs, the partitioned parameters among its arguments — or tensors sharing the storage of an open one (``p.data``
  aliases and views of it) — are made whole (all-gather); parameters opened by earlier calls and not used by this
  one are re-partitioned, least recently used first, once more than :data:`MAX_OPEN` are whole (broadcast of the full
  value from rank 0, keep the slice). So HF's ``post_init`` touching every weight in turn has a few parameters whole
  at a time, never the model. An alias such as ``w = p.data`` stays valid while ``p`` is among the last
  :data:`MAX_OPEN` parameters used; a write through an older alias would be lost (the rule for constructors).

Invariants: every rank runs the same constructor, so opens and closes (collectives) line up; the context owns no
state beyond its store, its mode and its hook handles, and an exception inside the block removes the hooks and
leaves no parameter open (the context's exit issues no collective on that path). Nested contexts: the outermost one
partitions (its hooks run first and a parameter is claimed only while nobody owns it); inner ones only see parameters
they own.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, Self, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from hybridzero.comm.collectives import Comm, init_distributed
from hybridzero.comm.ledger import Ledger
from hybridzero.config import load_config
from hybridzero.zero.init_store import InitStore
from hybridzero.zero.param_view import ZeroParameter, adopt
from hybridzero.zero.registry import REGISTRY

__all__ = ["MAX_OPEN", "Init"]

MAX_OPEN = 4
"""Parameters kept whole between torch calls (least recently used closed first): enough for ``b.data.copy_(a.data)``
and similar multi-parameter statements, small enough that a rank never holds more than 4 parameters whole."""


class _OpenOnUse(TorchFunctionMode):
    """Makes the partitioned parameters a torch call uses whole before it runs (see the module docstring)."""

    def __init__(self, store: InitStore) -> None:
        super().__init__()
        self.store = store

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.store.busy:
            self._prepare(_tensors_in((args, kwargs)))
        out = func(*args, **kwargs)
        if func is torch.Tensor.detach and isinstance(args[0], ZeroParameter) and _from_parameter_new():
            # ``nn.Parameter(p)`` of a partitioned ``p`` (torch's parametrizations, e.g. the ``weight_norm`` of HF's
            # audio models, inside ``GatheredParameters``): torch builds a parameter from a subclass instance only
            # if ``detach()`` keeps the class, so the new parameter is a ZeroParameter no one owns yet (no ``ds_*``
            # attributes) sharing the current (whole) value; registering it on a module partitions it as usual.
            return torch.Tensor._make_subclass(type(args[0]), out, False)
        return out

    def _prepare(self, tensors: list[torch.Tensor]) -> None:
        store = self.store
        wanted = [cast(nn.Parameter, t) for t in tensors if store.owns(t)]
        open_params = store.open_params()
        if open_params:
            by_storage = {ptr: p for p in open_params if (ptr := _storage_ptr(p)) != 0}
            wanted += [by_storage[ptr] for ptr in map(_storage_ptr, tensors) if ptr in by_storage]
        if wanted:
            store.use(wanted, MAX_OPEN)


def _from_parameter_new() -> bool:
    """Whether the torch call being handled was made by ``nn.Parameter.__new__`` (the frame above the mode's)."""
    return sys._getframe(2).f_code is nn.Parameter.__new__.__code__


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``, looking inside tuples, lists and dict values (how torch calls pass tensors)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _tensors_in(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors_in(item)]
    return []


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr() if not t.is_meta else 0
    except (RuntimeError, NotImplementedError):  # tensors without storage (some subclasses)
        return 0


class Init:
    """``with hybridzero.zero.Init(config_dict_or_path=cfg): model = Model(...)`` — DeepSpeed's signature.

    ``enabled=False`` builds eagerly. ``module=`` partitions an already built module right away. ``dtype`` casts
    floating parameters as they are partitioned (without it they keep the constructor's dtype: the engine keeps an
    fp32 master and casts for compute, so fp16/bf16 in the config do not down-cast here, unlike DeepSpeed).
    ``remote_device`` None or "cpu" (shards on the host) and ``pin_memory`` are honoured; "nvme" is refused.
    ``data_parallel_group`` is the process group to shard over (default: the world). ``config_dict_or_path`` /
    ``config`` are validated with :func:`hybridzero.config.load_config`. ``mpu``, ``zero_param_parallel_group`` and
    quantized-weight construction are not supported and raise. Call ``hybridzero.initialize`` after the block.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
    ) -> None:
        unsupported = {
            "mpu": mpu,
            "zero_param_parallel_group": zero_param_parallel_group,
            "sequence_data_parallel_group": sequence_data_parallel_group,
            "param_swapper": param_swapper,
        }
        for key, value in unsupported.items():
            if value is not None:
                raise ValueError(
                    f"zero.Init({key}=...) is not supported by hybridzero (no model/sequence parallelism "
                    f"or parameter swapping); pass {key}=None"
                )
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise ValueError(
                "zero.Init(zero_quantized_weights=True) is not supported: construction keeps full "
                "precision; set zero_quantized_weights in the engine config instead"
            )
        if remote_device not in (None, "cpu", "none"):
            raise ValueError(
                f"zero.Init(remote_device={remote_device!r}) is not supported; valid: None, 'cpu' "
                f"(NVMe offload is not implemented)"
            )
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"zero.Init(dtype={dtype!r}) must be a floating torch.dtype or None")
        if config_dict_or_path is not None and config is not None:
            raise ValueError("zero.Init: pass either config_dict_or_path= or config=, not both")
        del mem_efficient_linear  # DeepSpeed's memory-saving Linear autograd function: not needed, nothing patched
        self.enabled = enabled
        self.store: InitStore | None = None
        self._hooks: list[RemovableHandle] = []
        self._pending: list[nn.Parameter] = []
        self._mode: _OpenOnUse | None = None
        if not enabled:
            return
        init_distributed()
        self.comm = Comm(Ledger(), group=data_parallel_group, name="zero_init")
        cfg_source = config_dict_or_path if config_dict_or_path is not None else config
        self.config = load_config(cfg_source, self.comm.world_size) if cfg_source is not None else None
        # collectives on the accelerator under NCCL (the only non-polling backend we run), on the host under gloo
        on_gpu = torch.cuda.is_available() and not self.comm.polls
        comm_device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        shard_device = torch.device("cpu") if remote_device == "cpu" else None
        self.store = InitStore(self.comm, comm_device, shard_device, dtype, pin_memory)
        self.store.pause = self.paused
        if module is not None:
            self._partition_tree(module)

    # --- context manager ------------------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        if self.store is None:
            return self
        if self.store.active:
            raise RuntimeError("this zero.Init context is already active; nest a new zero.Init(...) instead")
        self.store.active = True
        self._hooks = [
            nn.modules.module.register_module_module_registration_hook(self._on_module),
            nn.modules.module.register_module_parameter_registration_hook(self._on_parameter),
        ]
        self._mode = _OpenOnUse(self.store)
        self._mode.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.store is None:
            return
        store, mode = self.store, self._mode
        try:
            if mode is not None:
                mode.__exit__(exc_type, exc, tb)
        finally:
            for handle in self._hooks:
                handle.remove()
            self._hooks = []
            self._mode = None
            store.active = False
        if exc_type is not None:
            store.close_all(src=None)  # no collective on the error path: a peer may not be here
            self._pending = []
            return
        store.close_all()
        pending, self._pending = self._pending, []
        for p in pending:
            self._claim(p)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The entered context suspended for a block: ``initialize`` called inside the ``zero.Init`` block that built
        the model (DeepSpeed accepts that). Every rank enters it together (open parameters are closed first, a
        collective); inside, nothing is partitioned or opened and the store counts as closed, so the engine can take
        the shards over; on exit the hooks and the torch-function mode are back."""
        store, mode = self.store, self._mode
        if store is None or mode is None or not store.active:
            yield
            return
        store.close_all()
        mode.__exit__(None, None, None)
        for handle in self._hooks:
            handle.remove()
        store.active = False
        try:
            yield
        finally:
            store.active = True
            self._hooks = [
                nn.modules.module.register_module_module_registration_hook(self._on_module),
                nn.modules.module.register_module_parameter_registration_hook(self._on_parameter),
            ]
            mode.__enter__()

    # --- hooks ------------------------------------------------------------------------------------------------
    def _on_module(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        """A child is assigned: its constructor has returned, so its parameters can be partitioned."""
        del parent, name
        if child is not None:
            self._partition_tree(child)

    def _on_parameter(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        """Remember a parameter registered directly on a module (partitioned with its module or on exit)."""
        del module, name
        if param is not None and REGISTRY.owner_of(param) is None:
            self._pending.append(param)

    def _partition_tree(self, module: nn.Module) -> None:
        for p in module.parameters():
            self._claim(p)

    def _claim(self, param: nn.Parameter) -> None:
        """Partition ``param`` unless some owner (this store, an outer context, an engine) already holds it."""
        assert self.store is not None
        if REGISTRY.owner_of(param) is None and not param.is_meta:
            self.store.partition(param)
            REGISTRY.register([param], self.store)
            adopt([param])  # DeepSpeed's read-only ds_* attributes, answered by the store (zero.param_view)

    # --- DeepSpeed-compatible extras ------------------------------------------------------------------------------
    def gathered(self, params: list[nn.Parameter], modifier_rank: int | None) -> Any:
        """``GatheredParameters`` over parameters this context partitioned (see :meth:`InitStore.gathered`)."""
        if self.store is None:
            raise RuntimeError("zero.Init(enabled=False) partitions nothing")
        return self.store.gathered(params, modifier_rank)
