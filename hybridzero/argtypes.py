"""Typed ``argparse`` arguments: the parser class every ``hybridzero`` command uses, and ``type=`` functions.

:class:`CLIParser` never expands an abbreviated option (``allow_abbrev=False``: ``--world 2`` is an unknown
argument, not ``--world_size 2``) and reports every error in one line, ``PROG: error: MESSAGE``, exit status 2 (no
usage block: the step commands have over a hundred flags; ``PROG --help`` lists them). Subparsers made by
``add_subparsers()`` are of the same class.

The ``type=`` functions are pure: they map the text of one argument to a value or raise
``argparse.ArgumentTypeError``, whose message argparse prefixes with ``argument --OPTION:``; so an error names the
option, the value given and the valid range, e.g. ``hybridzero plan: error: argument --nodes: expected an integer
>= 1, got '0'``. Floats are always finite (``nan``, ``inf`` and values that overflow to ``inf`` such as ``1e999``
are refused). A path is non-empty text without NUL bytes (the OS cannot open one, and Python's error would not name
the option).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["MAX_LOCAL_RANKS", "CLIParser", "float_range", "int_range", "path_text"]

# --world_size starts this many processes on one machine; far beyond any node's accelerators or cores
MAX_LOCAL_RANKS = 1024


class CLIParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` without abbreviations (unless asked for) and with one-line errors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE`` as one line (newlines in the message are escaped) and exit 2."""
        one_line = message.replace("\r", "\\r").replace("\n", "\\n")
        self.exit(2, f"{self.prog}: error: {one_line} (see {self.prog} --help)\n")


def _bound_text(kind: str, low: float | None, low_open: bool, high: float | None, high_open: bool) -> str:
    """``an integer >= 1``, ``a finite number > 0 and <= 1``, ... ."""
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high:g}")
    return f"{kind} {' and '.join(parts)}".rstrip()


def int_range(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """A ``type=`` function: an integer in ``[minimum, maximum]`` (``None``: unbounded on that side)."""
    want = _bound_text("an integer", minimum, False, maximum, False)

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    parse.__name__ = "int"
    return parse


def float_range(
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    min_open: bool = False,
    max_open: bool = False,
) -> Callable[[str], float]:
    """A ``type=`` function: a finite float in the range (``min_open``/``max_open``: that end excluded)."""
    want = _bound_text("a finite number", minimum, min_open, maximum, max_open)

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        low_bad = minimum is not None and (value <= minimum if min_open else value < minimum)
        high_bad = maximum is not None and (value >= maximum if max_open else value > maximum)
        if not math.isfinite(value) or low_bad or high_bad:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    parse.__name__ = "float"
    return parse


def path_text(text: str) -> str:
    """A ``type=`` function: ``text`` unchanged if it can name a file (non-empty, no NUL byte)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"expected a path without NUL bytes, got {text!r}")
    return text
