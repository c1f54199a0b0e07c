"""What a reward function returns, as the trainer takes it: ``n`` floats or ``None``s, checked and converted.

Accepted (as TRL accepts them): a list, tuple or other sequence, a 1-D ``numpy`` array or ``torch`` tensor, whose
items are ``None`` or real numbers — Python ``int``/``float``, ``numpy`` scalars (``float32``, ``float64``,
``int64``...), 0-d arrays or tensors — each converted with ``float``. Refused with a :class:`RewardCallError` naming
what came back: a string, bytes, a mapping or set (no order), a generator or iterator (no length, read once), an
object without a length, a wrong length, a ``bool`` (an ambiguous score) or any other item (a string, a list...).
NaN/inf pass here: the caller reports them by sample index. Messages are one line, a returned value shown at most
``_SHOWN`` characters.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Set
from typing import Any

import torch

__all__ = ["RewardCallError", "as_values", "is_plain", "one_line"]

_SCALARS = frozenset({str, int, float, bool, type(None)})
_CONTAINERS = _SCALARS | {list, dict}
_SHOWN = 80


class RewardCallError(Exception):
    """One call failed; ``samples`` are the indices it concerns (``None``: the whole call)."""

    def __init__(self, message: str, samples: list[int] | None = None) -> None:
        super().__init__(message)
        self.samples = samples


def one_line(text: str, limit: int = 300) -> str:
    """``text``'s first non-empty line, cut to ``limit`` characters (error messages stay one line)."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _shown(v: Any) -> str:
    try:
        text = repr(v)
    except Exception:  # noqa: BLE001 -- a broken __repr__ must not hide the real error
        text = f"<{type(v).__name__}>"
    return one_line(text, _SHOWN)


def _is_array(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor) or type(obj).__module__ == "numpy"


def _item(v: Any) -> Any:
    """A 0-d array/tensor or numpy scalar as its Python value (other values unchanged)."""
    if _is_array(v) and getattr(v, "ndim", None) == 0:
        return v.item()
    return v


def as_values(result: Any, n: int) -> list[float | None]:
    """``result`` as ``n`` floats or ``None``s (module docstring)."""
    if _is_array(result):
        if getattr(result, "ndim", 1) != 1:
            shape = tuple(getattr(result, "shape", ()))
            raise RewardCallError(f"returned an array of shape {shape}; expected {n} values (1-D)")
        result = result.detach().cpu().tolist() if isinstance(result, torch.Tensor) else result.tolist()
    if isinstance(result, (str, bytes, bytearray, Mapping, Set)) or not hasattr(result, "__len__"):
        raise RewardCallError(
            f"returned a {type(result).__name__} ({_shown(result)}); expected a list of {n} floats or None"
        )
    if len(result) != n:
        raise RewardCallError(f"returned {len(result)} values for {n} completions")
    values: list[float | None] = []
    for i, raw in enumerate(result):
        v = _item(raw)
        if v is None:
            values.append(None)
        elif isinstance(v, numbers.Real) and not isinstance(v, bool) and type(v).__name__ != "bool_":
            values.append(float(v))
        else:
            raise RewardCallError(f"value {i} is a {type(raw).__name__} ({_shown(raw)}); expected a float or None", [i])
    return values


def is_plain(obj: Any) -> bool:
    """True when JSON carries ``obj`` unchanged: exactly ``None``/``bool``/``int``/``float``/``str``, and lists
    and string-keyed dicts of those (a tuple would come back a list, a subclass as its base, an int key a str).
    Lists are checked a level at a time by their set of element types (C speed for the long lists of ids)."""
    kind = type(obj)
    if kind in _SCALARS:
        return True
    if kind is list:
        kinds = set(map(type, obj))
        return kinds <= _SCALARS or (kinds <= _CONTAINERS and all(is_plain(v) for v in obj))
    if kind is dict:
        return set(map(type, obj)) <= {str} and is_plain(list(obj.values()))
    return False
