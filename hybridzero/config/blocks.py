"""Reading one JSON object ("block") of a DeepSpeed config into dataclass kwargs.

A block's valid keys are the spellings of the specs on a dataclass's fields plus
any keys the caller handles itself; keys DeepSpeed accepts but hybridzero does
not act on are *ignored* (accepted, warned once); anything else is an error
naming the dotted key and the nearest valid one.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import ConfigError, join_key, show, unknown_key_error
from .values import SPEC, Spec, coerce, is_auto

__all__ = ["Diagnostics", "as_mapping", "check_keys", "known_keys", "take_fields"]


class Diagnostics:
    """Warnings gathered during one ``load_config`` call.

    Invariant: at most one message per dotted key (the first one noted wins), so
    :meth:`emit` warns once per key per call. Instances are local to a call;
    there is no module-level state.
    """

    def __init__(self) -> None:
        self._messages: dict[str, str] = {}

    def note(self, key: str, message: str) -> None:
        """Record ``message`` for ``key`` unless ``key`` already has one."""
        self._messages.setdefault(key, message)

    @property
    def messages(self) -> tuple[str, ...]:
        """The recorded messages, in the order their keys were first noted."""
        return tuple(self._messages.values())

    def emit(self, stacklevel: int) -> None:
        """Issue every recorded message as a ``UserWarning``."""
        for message in self._messages.values():
            warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)


def as_mapping(value: Any, key: str) -> Mapping[str, Any]:
    """``value`` if it is a JSON object, else a ConfigError naming ``key``."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key} = {show(value)} is invalid: expected a JSON object", key=key, value=value)
    return value


def _specs(cls: type) -> Iterable[tuple[str, Spec]]:
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(SPEC)
        if spec is not None:
            yield f.name, spec


def known_keys(cls: type) -> frozenset[str]:
    """Every JSON spelling that maps onto a spec-carrying field of ``cls``."""
    return frozenset(name for _, spec in _specs(cls) for name in spec.spellings)


def check_keys(
    block: Mapping[str, Any],
    prefix: str,
    known: frozenset[str],
    ignored: frozenset[str],
    diag: Diagnostics,
) -> None:
    """Reject unknown keys of ``block``; note a warning for each ignored one.

    ``known`` and ``ignored`` must be disjoint. The error for an unknown key
    suggests the closest of ``known | ignored``.
    """
    for name in block:
        if not isinstance(name, str):
            where = prefix or "the top level"
            raise ConfigError(f"{where} has a non-string key {name!r}; JSON keys are strings", key=prefix, value=name)
        if name in known:
            continue
        key = join_key(prefix, name)
        if name not in ignored:
            raise unknown_key_error(prefix, name, known | ignored)
        diag.note(key, f"config key '{key}' is accepted for DeepSpeed compatibility but ignored by hybridzero")


def take_fields(cls: type, block: Mapping[str, Any], prefix: str, diag: Diagnostics) -> dict[str, Any]:
    """Keyword arguments for ``cls`` from the spec-carrying keys present in ``block``.

    Each field may be spelled once (two spellings of one field is an error);
    deprecated spellings warn; ``"auto"`` on an ``auto_default`` key leaves the
    field at its default (warning ``auto_note`` if the spec has one). Values are
    coerced with the dotted key ``prefix.<spelling>`` so errors name what the user wrote.
    """
    kwargs: dict[str, Any] = {}
    for field_name, spec in _specs(cls):
        present = [name for name in spec.spellings if name in block]
        if not present:
            continue
        if len(present) > 1:
            keys = " and ".join(f"'{join_key(prefix, name)}'" for name in present)
            raise ConfigError(f"{keys} set the same option; give only '{join_key(prefix, spec.key)}'", key=prefix)
        name = present[0]
        key = join_key(prefix, name)
        value = block[name]
        if name in spec.deprecated:
            diag.note(key, f"config key '{key}' is deprecated; use '{join_key(prefix, spec.key)}'")
        if is_auto(value) and spec.auto_default:
            if spec.auto_note:
                diag.note(key, f"{key} = 'auto': {spec.auto_note}")
            continue
        kwargs[field_name] = coerce(value, spec, key)
    return kwargs
