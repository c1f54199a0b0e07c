"""Typed reading of single config values, driven by a declarative :class:`Spec`.

A ``Spec`` says how one DeepSpeed JSON key maps onto a typed field: its kind,
bounds, choices, spellings and whether ``"auto"`` stands for the default.
:func:`coerce` turns a raw JSON value into the typed value or raises a
:class:`ConfigError` naming the dotted key, the value and what is valid.
All functions here are pure; the only module-level names are immutable.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from .errors import ConfigError, show

__all__ = [
    "AUTO",
    "SPEC",
    "Spec",
    "coerce",
    "describe",
    "freeze",
    "is_auto",
    "spec_field",
    "thaw",
    "validate_fields",
]

AUTO = "auto"
SPEC = "hybridzero_spec"  # dataclass field metadata key holding the field's Spec

Kind = Literal["int", "float", "bool", "str", "pair", "floats"]


@dataclass(frozen=True)
class Spec:
    """How one JSON key maps onto a typed field.

    Invariants: ``key`` is the canonical DeepSpeed spelling and never appears in
    ``aliases``/``deprecated`` (other accepted spellings; ``deprecated`` ones warn);
    bounds apply to numbers (and to every member of a ``pair`` / ``floats`` list); ``choices`` apply to
    strings, are canonical and matched case-insensitively; ``optional`` admits JSON
    ``null``; ``auto_default`` makes ``"auto"`` mean "use the field default", otherwise
    ``"auto"`` is an error; ``auto_note`` (if set) is warned when ``"auto"`` is used.
    """

    key: str
    kind: Kind
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False
    choices: tuple[str, ...] = ()
    optional: bool = False
    auto_default: bool = False
    auto_note: str = ""
    aliases: tuple[str, ...] = ()
    deprecated: tuple[str, ...] = ()

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every accepted spelling of this key, canonical first."""
        return (self.key, *self.aliases, *self.deprecated)


def spec_field(spec: Spec, default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field carrying ``spec`` in its metadata (required if no default)."""
    return dataclasses.field(default=default, metadata={SPEC: spec})


def is_auto(value: Any) -> bool:
    """True for the HF-Trainer placeholder ``"auto"`` (exact spelling, as DeepSpeed)."""
    return isinstance(value, str) and value == AUTO


def _fmt(bound: float) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


def _bounds_text(spec: Spec) -> str:
    lo, hi = spec.minimum, spec.maximum
    if lo is not None and hi is not None:
        left = "(" if spec.exclusive_minimum else "["
        right = ")" if spec.exclusive_maximum else "]"
        return f" in {left}{_fmt(lo)}, {_fmt(hi)}{right}"
    if lo is not None:
        return f" {'>' if spec.exclusive_minimum else '>='} {_fmt(lo)}"
    if hi is not None:
        return f" {'<' if spec.exclusive_maximum else '<='} {_fmt(hi)}"
    return ""


def describe(spec: Spec) -> str:
    """Human description of what ``spec`` accepts, e.g. ``an integer >= 0``."""
    if spec.kind == "bool":
        text = "true or false"
    elif spec.kind == "str":
        text = "one of " + ", ".join(repr(c) for c in spec.choices) if spec.choices else "a string"
    elif spec.kind == "pair":
        text = "a pair [a, b] of numbers" + _bounds_text(spec)
    elif spec.kind == "floats":
        text = "a number or a list of numbers (one per param group)" + _bounds_text(spec)
    else:
        text = ("an integer" if spec.kind == "int" else "a number") + _bounds_text(spec)
    if spec.optional:
        text += " or null"
    if spec.auto_default:
        text += ' or "auto" (the default)'
    return text


def _invalid(value: Any, spec: Spec, key: str) -> ConfigError:
    return ConfigError(f"{key} = {show(value)} is invalid: expected {describe(spec)}", key=key, value=value)


def _to_int(value: Any, spec: Spec, key: str) -> int:
    if isinstance(value, bool):
        raise _invalid(value, spec, key)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)  # JSON writers emit 5e7 for integer sizes; accept when integral
    raise _invalid(value, spec, key)


def _to_float(value: Any, spec: Spec, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(value, spec, key)
    if not math.isfinite(value):
        raise _invalid(value, spec, key)
    return float(value)


def _to_bool(value: Any, spec: Spec, key: str) -> bool:
    if not isinstance(value, bool):
        raise _invalid(value, spec, key)
    return value


def _to_str(value: Any, spec: Spec, key: str) -> str:
    if not isinstance(value, str):
        raise _invalid(value, spec, key)
    if not spec.choices:
        return value
    for choice in spec.choices:
        if choice.lower() == value.lower():
            return choice
    raise _invalid(value, spec, key)


def _all_numbers(items: Any) -> bool:
    return all(isinstance(m, (int, float)) and not isinstance(m, bool) and math.isfinite(m) for m in items)


def _to_pair(value: Any, spec: Spec, key: str) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not _all_numbers(value):
        raise _invalid(value, spec, key)
    return (float(value[0]), float(value[1]))


def _to_floats(value: Any, spec: Spec, key: str) -> float | tuple[float, ...]:
    if not isinstance(value, (list, tuple)):
        return _to_float(value, spec, key)
    if not value or not _all_numbers(value):
        raise _invalid(value, spec, key)
    return tuple(float(m) for m in value)


_CONVERTERS: Mapping[str, Callable[[Any, Spec, str], Any]] = MappingProxyType(
    {"int": _to_int, "float": _to_float, "bool": _to_bool, "str": _to_str, "pair": _to_pair, "floats": _to_floats}
)


def _in_bounds(number: float, spec: Spec) -> bool:
    lo, hi = spec.minimum, spec.maximum
    if lo is not None and (number <= lo if spec.exclusive_minimum else number < lo):
        return False
    if hi is not None and (number >= hi if spec.exclusive_maximum else number > hi):
        return False
    return True


def coerce(value: Any, spec: Spec, key: str) -> Any:
    """Validate ``value`` against ``spec`` and return it in canonical typed form.

    Pure and idempotent: ``coerce(coerce(v, s, k), s, k) == coerce(v, s, k)``.
    ``"auto"`` reaching this point is an error (callers resolve ``auto_default`` keys
    before calling), with a message telling the user which key to set.
    """
    if value is None:
        if spec.optional:
            return None
        raise _invalid(value, spec, key)
    if is_auto(value):
        raise ConfigError(
            f"{key} = 'auto' cannot be resolved: 'auto' is filled in by the Hugging Face Trainer, "
            f"and there is none here; set {key} explicitly to {describe(spec)}",
            key=key,
            value=value,
        )
    typed = _CONVERTERS[spec.kind](value, spec, key)
    numbers = typed if isinstance(typed, tuple) else (typed,)
    if spec.kind in ("int", "float", "pair", "floats") and not all(_in_bounds(n, spec) for n in numbers):
        raise _invalid(value, spec, key)
    return typed


def validate_fields(obj: Any, prefix: str) -> None:
    """Coerce every spec-carrying field of the frozen dataclass ``obj`` in place.

    Used from ``__post_init__`` so that direct construction enforces the same
    invariants as :func:`hybridzero.config.load_config`. Error keys are
    ``prefix + "." + spec.key``.
    """
    for f in dataclasses.fields(obj):
        spec = f.metadata.get(SPEC)
        if spec is None:
            continue
        key = f"{prefix}.{spec.key}" if prefix else spec.key
        object.__setattr__(obj, f.name, coerce(getattr(obj, f.name), spec, key))


def freeze(value: Any) -> Any:
    """Deep read-only copy: mappings become ``MappingProxyType``, lists become tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Inverse of :func:`freeze`: plain ``dict``/``list`` copy, JSON-serialisable."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value
