"""Dependency-free visualisation: PNG line charts drawn with a built-in bitmap font."""
from __future__ import annotations

from hybridzero.viz.png import encode_png, line_chart

__all__ = ["encode_png", "line_chart"]
