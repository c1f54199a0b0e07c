"""The one protocol shared by checkpoint readers and the sharding core: named tensors readable by flat range.

A neutral module (no hybridzero imports) so that ``checkpoint/`` implements it and ``zero/`` consumes it without
either importing the other.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = ["FLOAT_EXPECTED", "TensorSource", "check_float", "check_range", "dtype_label", "resolve_name"]

FLOAT_EXPECTED = "a floating-point tensor (float16, bfloat16, float32 or float64: those are converted)"


@runtime_checkable
class TensorSource(Protocol):
    """Named tensors readable by flat element range.

    Invariants every implementation keeps: ``names()`` is stable for the life of the source;
    ``read_flat(n, lo, hi)`` returns a fresh 1-D tensor (never a view of storage the source
    keeps) of ``hi - lo`` elements in ``dtype(n)``, equal to the row-major flattening of the
    tensor restricted to ``[lo, hi)``; ``0 <= lo <= hi <= shape(n).numel()`` or ValueError.
    """

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> torch.Size: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor: ...


def resolve_name(source: TensorSource, aliases: Sequence[str]) -> str:
    """The first of ``aliases`` present in ``source``.

    Tied weights are saved under one name only (e.g. GPT-2/OPT save the embedding, not
    ``lm_head.weight``), so callers list every acceptable name. If none is present, raise
    KeyError naming all aliases and the source, with up to 5 close names as hints.
    """
    if isinstance(aliases, str) or not aliases:
        raise ValueError(f"aliases must be a non-empty sequence of names, got {aliases!r}")
    available = source.names()
    present = set(available)
    for alias in aliases:
        if alias in present:
            return alias
    close: list[str] = []
    for alias in aliases:
        for match in difflib.get_close_matches(alias, available, n=5, cutoff=0.6):
            if match not in close:
                close.append(match)
    hint = f"; close names: {close[:5]}" if close else ""
    raise KeyError(f"none of {list(aliases)} found in {source!r}{hint}")


def check_range(name: str, numel: int, lo: int, hi: int) -> None:
    """Raise ValueError unless ``lo``/``hi`` are ints with ``0 <= lo <= hi <= numel``."""
    for label, value in (("lo", lo), ("hi", hi)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{label} for {name!r} must be an int, got {type(value).__name__}")
    if not 0 <= lo <= hi <= numel:
        raise ValueError(f"bad range [{lo}, {hi}) for {name!r} with {numel} elements")


def dtype_label(dtype: torch.dtype) -> str:
    """``torch.int32`` -> ``"int32"``."""
    return str(dtype).removeprefix("torch.")


def check_float(name: str, source: object, dtype: torch.dtype) -> None:
    """Raise ValueError naming tensor ``name`` of ``source`` unless ``dtype`` is floating point: parameters and
    their optimizer state are floats, and an integer or bool tensor is never cast to one silently."""
    if not dtype.is_floating_point:
        raise ValueError(f"tensor {name!r} of {source!r} has dtype {dtype_label(dtype)}, expected {FLOAT_EXPECTED}")
