"""DeepSpeed's per-parameter ZeRO-3 attributes (``ds_id``, ``ds_shape``, ``ds_numel``, ``ds_tensor``,
``ds_status``, ``ds_persist``) without storing anything on tensors.

DeepSpeed sets these attributes on every parameter that ``zero.Init`` or a ZeRO-3 engine partitions, and code
written for it (its unit tests, DeepSpeed-Chat's ``hasattr(p, "ds_id") and p.ds_status == NOT_AVAILABLE``) reads
them. hybridzero keeps a parameter's sharded state in its owner (an engine's gather groups, or a ``zero.Init``
store) and instead gives each such parameter the class :class:`ZeroParameter`, an ``nn.Parameter`` subclass whose
attributes are *properties that ask the owner* found through :data:`hybridzero.zero.registry.REGISTRY`. Changing the
class is torch's own mechanism for a parameter changing kind (``UninitializedParameter.materialize``); nothing is
written into the tensor.

Invariants: an owner answers through :class:`DsOwner` (``ds_attribute(param, name)``) and raises ``AttributeError``
for a parameter it does not partition (an engine at stage 0-2); a ``ZeroParameter`` no owner holds (a copy, after
``engine.destroy()``) has none of the attributes (``hasattr`` is False, as for a plain parameter); the attributes are
read-only but for ``ds_tensor.data = value``, which writes ``value`` into this rank's part of the parameter (its
master) through the owner, as DeepSpeed's tests write its live partition (:class:`LocalPart`); ``ds_status`` is
``AVAILABLE`` exactly while the full value is on this rank.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from hybridzero.zero.registry import REGISTRY

__all__ = ["DS_ATTRIBUTES", "DsOwner", "LocalPart", "ZeroParamStatus", "ZeroParameter", "adopt", "release"]

DS_ATTRIBUTES: tuple[str, ...] = ("ds_id", "ds_shape", "ds_numel", "ds_tensor", "ds_status", "ds_persist")


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's values: whole on this rank, partitioned, or being gathered."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


@runtime_checkable
class DsOwner(Protocol):
    """An owner of sharded parameters that can describe them in DeepSpeed's terms."""

    def ds_attribute(self, param: nn.Parameter, name: str) -> Any:
        """The value of ``name`` (one of :data:`DS_ATTRIBUTES`) for ``param``; ``AttributeError`` if not provided."""
        ...


class LocalPart(torch.Tensor):
    """``ds_tensor``'s answer: a copy of this rank's part of a parameter (a plain tensor in every operation) whose
    ``.data = value`` also writes ``value`` into the owner's shard, as assigning DeepSpeed's ``ds_tensor.data``
    replaces its live partition. Only that assignment writes; in-place edits of the copy stay on the copy.

    Invariant: after ``part.data = value``, the parameter's next gather reads ``value`` on this rank's part (the
    owner validates the size and keeps every derived cache consistent, as ``safe_set_local_fp32_param`` does)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    _write: Callable[[torch.Tensor], None]

    @staticmethod
    def of(copy: torch.Tensor, write: Callable[[torch.Tensor], None]) -> LocalPart:
        """Wrap ``copy`` (a tensor this object now owns) with the owner's writer."""
        part = copy.as_subclass(LocalPart)
        part._write = write
        return part

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (sent to another process, saved) as the plain tensor it is: the writer stays here."""
        return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor), protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        """A deep copy is a plain tensor of the same values (writing it writes nothing back)."""
        return self.as_subclass(torch.Tensor).clone()

    @property
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)  # type: ignore[attr-defined]

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        self._write(value)
        torch.Tensor.data.__set__(self, value)  # type: ignore[attr-defined]


class ZeroParameter(nn.Parameter):
    """A partitioned parameter, with DeepSpeed's ``ds_*`` attributes as read-only properties."""

    def _ask(self, name: str) -> Any:
        owner = REGISTRY.owner_of(self)
        if not isinstance(owner, DsOwner):
            raise AttributeError(f"{name}: this parameter is not partitioned by a zero.Init context or ZeRO-3 engine")
        return owner.ds_attribute(self, name)

    @property
    def ds_id(self) -> int:
        """A number unique among the parameters of the owner (engine order, or construction order under Init)."""
        return int(self._ask("ds_id"))

    @property
    def ds_shape(self) -> torch.Size:
        """The parameter's full shape."""
        return torch.Size(self._ask("ds_shape"))

    @property
    def ds_numel(self) -> int:
        """The parameter's full number of elements."""
        return int(self.ds_shape.numel())

    @property
    def ds_tensor(self) -> torch.Tensor:
        """A copy of this rank's part of the parameter, flattened (possibly empty); ``ds_tensor.data = value`` writes
        the part (:class:`LocalPart`)."""
        return self._ask("ds_tensor")

    @property
    def ds_status(self) -> ZeroParamStatus:
        """Whether the full value is on this rank now."""
        return self._ask("ds_status")

    @property
    def ds_persist(self) -> bool:
        """Whether the parameter is persistent: kept whole on every rank between uses (an engine's parameters of at
        most ``stage3_param_persistence_threshold`` elements; never under ``zero.Init`` before an engine owns it)."""
        return bool(self._ask("ds_persist"))

    def ds_summary(self) -> dict[str, Any]:
        """DeepSpeed's one-line description of the parameter (for logs and assertion messages): its id, status,
        local and full sizes and shapes, ``requires_grad``, the local gradient's shape, persistence, and the local
        part's shape (read from the owner now)."""
        grad = self.grad
        return {
            "id": self.ds_id,
            "status": self.ds_status.name,
            "numel": self.numel(),
            "ds_numel": self.ds_numel,
            "shape": tuple(self.shape),
            "ds_shape": tuple(self.ds_shape),
            "requires_grad": self.requires_grad,
            "grad_shape": tuple(grad.shape) if grad is not None else None,
            "persist": self.ds_persist,
            "ds_tensor.shape": tuple(self.ds_tensor.shape),
        }


def _swap(params: Iterable[nn.Parameter], old: type[nn.Parameter], new: type[nn.Parameter]) -> None:
    for p in params:
        if type(p) is old:
            p.__class__ = new


def adopt(params: Iterable[nn.Parameter]) -> None:
    """Give plain parameters the class :class:`ZeroParameter` (other subclasses are left as they are)."""
    _swap(params, nn.Parameter, ZeroParameter)


def release(params: Iterable[nn.Parameter]) -> None:
    """Give :class:`ZeroParameter` parameters back their plain class."""
    _swap(params, ZeroParameter, nn.Parameter)
