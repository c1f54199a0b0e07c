"""Typed JSON values for the config models: one validator per kind of value (``Annotated[int, integer(0, 3)]``),
and per-key metadata.

Each type's validator runs *before* pydantic's own and is strict the way DeepSpeed users need: booleans are never
numbers, strings are never coerced to numbers, an integral float (``5e7``) is an integer, a string choice is matched
case-insensitively and returned in its canonical spelling. A validator raises :class:`ValueProblem` saying what is
valid; :mod:`.errors` adds the dotted key and the value. All functions are pure; module-level names are immutable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pydantic import AliasChoices, BeforeValidator, Field

__all__ = [
    "AUTO",
    "BlockProblem",
    "KeyInfo",
    "ValueProblem",
    "boolean",
    "choice",
    "floats",
    "freeze",
    "integer",
    "interval",
    "is_auto",
    "key",
    "key_info",
    "number",
    "optional",
    "pair",
    "text",
    "texts",
    "thaw",
]

AUTO = "auto"


class ValueProblem(ValueError):
    """A single value is invalid; ``expected`` says what would be valid (the key is added by the caller)."""

    def __init__(self, expected: str, *, auto: bool = False) -> None:
        super().__init__(expected)
        self.expected = expected
        self.auto = auto  # the value was the HF-Trainer placeholder "auto"


class BlockProblem(ValueError):
    """A rule across keys of one block is broken. ``template`` holds ``{0}``, ``{1}``... for the dotted keys of
    ``names`` (relative to the block); :mod:`.errors` fills them in with the block's path."""

    def __init__(self, template: str, names: tuple[str, ...], value: Any = None) -> None:
        super().__init__(template.format(*names))
        self.template, self.names, self.value = template, names, value


@dataclass(frozen=True)
class KeyInfo:
    """What one DeepSpeed JSON key of a model is: its spellings and whether hybridzero acts on it.

    Invariants: ``name`` is the canonical DeepSpeed spelling; ``aliases`` are accepted silently, ``deprecated``
    spellings warn; ``auto`` makes ``"auto"`` mean the default (``auto_note``, if set, is warned when used);
    ``acts`` False means the key is accepted for DeepSpeed compatibility and warned about once by name.
    """

    name: str
    aliases: tuple[str, ...] = ()
    deprecated: tuple[str, ...] = ()
    auto: bool = False
    auto_note: str = ""
    acts: bool = True
    note: str = ""  # for keys that act: where (a method or module), for readers and the key walk

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every accepted spelling, canonical first."""
        return (self.name, *self.aliases, *self.deprecated)


def key(
    default: Any,
    name: str,
    *aliases: str,
    deprecated: tuple[str, ...] = (),
    auto: bool = False,
    auto_note: str = "",
    acts: bool = True,
    note: str = "",
) -> Any:
    """A pydantic ``Field`` for DeepSpeed key ``name`` (and its other spellings) carrying its :class:`KeyInfo`."""
    info = KeyInfo(name, tuple(aliases), tuple(deprecated), auto, auto_note, acts, note)
    extra: Any = {"key": info}  # read back by key_info; pydantic keeps json_schema_extra as given
    return Field(default, validation_alias=AliasChoices(*info.spellings), json_schema_extra=extra)


def key_info(field: Any) -> KeyInfo | None:
    """The :class:`KeyInfo` of a pydantic ``FieldInfo``, or None for fields that are not JSON keys."""
    extra = field.json_schema_extra
    return extra.get("key") if isinstance(extra, Mapping) else None


def is_auto(value: Any) -> bool:
    """True for the HF-Trainer placeholder ``"auto"`` (exact spelling, as DeepSpeed)."""
    return isinstance(value, str) and value == AUTO


def _fmt(bound: float) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


def bounds_text(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    """`` in [0, 3]``, `` >= 1``, `` > 0``... (empty without bounds)."""
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{_fmt(lo)}, {_fmt(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {_fmt(lo)}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {_fmt(hi)}"
    return ""


def _in_bounds(x: float, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> bool:
    if lo is not None and (x <= lo if lo_open else x < lo):
        return False
    return not (hi is not None and (x >= hi if hi_open else x > hi))


def _checked(expected: str, convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A before-validator: ``convert`` or a :class:`ValueProblem` (``"auto"`` gets its own)."""

    def validate(value: Any) -> Any:
        if is_auto(value):
            raise ValueProblem(expected, auto=True)
        result = convert(value)
        if result is _BAD:
            raise ValueProblem(expected)
        return result

    return validate


_BAD = object()


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer(lo: int | None = None, hi: int | None = None) -> BeforeValidator:
    """An int in bounds; an integral float (JSON writers emit ``5e7``) counts; bools and strings do not."""

    def convert(v: Any) -> Any:
        if isinstance(v, float) and _is_number(v) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not _in_bounds(v, lo, hi, False, False):
            return _BAD
        return v if hi is not None or v < INT64_LIMIT else _BAD

    text = "an integer" + bounds_text(lo, hi) + (" below 2**63" if hi is None else "")
    return BeforeValidator(_checked(text, convert))


INT64_LIMIT = 2**63
"""Integers without an explicit upper bound stay below this (every count fits an int64; no OverflowError later)."""


NEVER = 2**62
"""How an ``interval`` of ``inf`` ("never") is kept: an int no step counter reaches."""


def interval() -> BeforeValidator:
    """A step interval: an int >= 1, or ``inf`` for "never" (kept as :data:`NEVER`), which DeepSpeed accepts and
    Hugging Face Accelerate writes (``steps_per_print = float("inf")``)."""

    def convert(v: Any) -> Any:
        if isinstance(v, float) and v == float("inf"):
            return NEVER
        if isinstance(v, float) and _is_number(v) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return _BAD
        return v

    return BeforeValidator(_checked("an integer >= 1 or inf (never)", convert))


def number(
    lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False
) -> BeforeValidator:
    """A finite float in bounds (ints accepted and converted)."""

    def convert(v: Any) -> Any:
        return float(v) if _is_number(v) and _in_bounds(v, lo, hi, lo_open, hi_open) else _BAD

    return BeforeValidator(_checked("a number" + bounds_text(lo, hi, lo_open, hi_open), convert))


def _bool(v: Any) -> Any:
    return v if isinstance(v, bool) else _BAD


boolean = BeforeValidator(_checked("true or false", _bool))
text = BeforeValidator(_checked("a string", lambda v: v if isinstance(v, str) else _BAD))


def choice(*choices: str) -> BeforeValidator:
    """One of ``choices``, matched case-insensitively, returned canonical."""
    by_lower = MappingProxyType({c.lower(): c for c in choices})

    def convert(v: Any) -> Any:
        return by_lower.get(v.lower(), _BAD) if isinstance(v, str) else _BAD

    return BeforeValidator(_checked("one of " + ", ".join(repr(c) for c in choices), convert))


def pair(lo: float, hi: float, hi_open: bool) -> BeforeValidator:
    """A pair ``[a, b]`` of numbers in bounds, as a tuple of floats."""

    def convert(v: Any) -> Any:
        if (
            not isinstance(v, (list, tuple))
            or len(v) != 2
            or not all(_is_number(m) for m in v)
            or not all(_in_bounds(m, lo, hi, False, hi_open) for m in v)
        ):
            return _BAD
        return (float(v[0]), float(v[1]))

    expected = "a pair [a, b] of numbers" + bounds_text(lo, hi, False, hi_open)
    return BeforeValidator(_checked(expected, convert))


def floats(lo: float, *, nullable: bool = False) -> BeforeValidator:
    """A number or a non-empty list of numbers (one per param group), each >= ``lo``; lists become tuples."""

    def convert(v: Any) -> Any:
        if v is None and nullable:
            return None
        items = v if isinstance(v, (list, tuple)) else [v]
        if not items or not all(_is_number(m) and m >= lo for m in items):
            return _BAD
        return tuple(float(m) for m in v) if isinstance(v, (list, tuple)) else float(v)

    expected = "a number or a list of numbers (one per param group)" + bounds_text(lo, None)
    expected += " or null" if nullable else ""
    return BeforeValidator(_checked(expected, convert))


def texts() -> BeforeValidator:
    """A string or a list of strings, as a list of strings without repeats (first occurrence kept): DeepSpeed's
    coercion of a lone string to a one-element list."""

    def convert(v: Any) -> Any:
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, (list, tuple)) or not all(isinstance(m, str) for m in items):
            return _BAD
        return list(dict.fromkeys(items))

    return BeforeValidator(_checked("a string or a list of strings", convert))


def optional(validator: BeforeValidator) -> BeforeValidator:
    """``validator`` that also admits JSON ``null``; the problem text gains ``or null``."""
    inner = validator.func

    def validate(value: Any) -> Any:
        if value is None:
            return None
        try:
            return inner(value)  # type: ignore[call-arg]
        except ValueProblem as problem:
            raise ValueProblem(problem.expected + " or null", auto=problem.auto) from None

    return BeforeValidator(validate)


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
