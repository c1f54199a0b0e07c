"""The config error type and the helpers that phrase its messages.

Every message names the offending key as a dotted path from the top of the DeepSpeed JSON
(``zero_optimization.stage``), shows the bad value in JSON-like form, and says what would have been valid.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

__all__ = ["ConfigAssertionError", "ConfigError", "join_key", "show", "unknown_key_error"]


class ConfigError(ValueError):
    """A DeepSpeed-style config is invalid.

    Invariants: ``str(error)`` names the dotted key (when one is involved), the bad value and what would be valid;
    ``key`` / ``value`` repeat them for programmatic use (``key`` is ``None`` only for errors about the whole
    document, e.g. an unreadable file, and then the message names the file instead).
    """

    def __init__(self, message: str, *, key: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.key = key
        self.value = value


class ConfigAssertionError(ConfigError, AssertionError):
    """A :class:`ConfigError` for a rule DeepSpeed enforces with an ``assert``: also an ``AssertionError``, the type
    DeepSpeed raises there (its tests catch that)."""


def join_key(prefix: str, name: str) -> str:
    """Dotted path of ``name`` inside the block at ``prefix`` (``""`` is the top level)."""
    return f"{prefix}.{name}" if prefix else name


def show(value: Any) -> str:
    """Render a config value the way it would be written in JSON (strings quoted)."""
    if value is True:
        return "true"
    if value is False:
        return "false"
    if value is None:
        return "null"
    return repr(value)


def unknown_key_error(prefix: str, name: str, valid: Iterable[str]) -> ConfigError:
    """Error for a key that is not valid in the block at ``prefix``: the closest valid key (difflib) or the list."""
    key = join_key(prefix, name)
    candidates = sorted(valid)
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean '{close[0]}'?"
    elif candidates:
        hint = "valid keys here: " + ", ".join(candidates)
    else:
        hint = "this block takes no keys"
    return ConfigError(f"unknown config key '{key}'; {hint}", key=key, value=name)
