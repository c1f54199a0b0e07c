"""Layering of the checkpoint code (issue 13): ``checkpoint/`` is the on-disk format and tensor sources and never
imports the engine's layers; ``zero/`` never imports ``checkpoint/`` (the source protocol is neutral)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hybridzero"


def _imports(folder: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for file in sorted((PACKAGE / folder).glob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        out[file.name] = {n for n in names if n.startswith("hybridzero")}
    return out


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        (
            "checkpoint",
            ("hybridzero.zero", "hybridzero.runtime", "hybridzero.optim", "hybridzero.rlhf", "hybridzero.cli"),
        ),
        ("zero", ("hybridzero.checkpoint",)),
    ],
)
def test_layers_point_down(folder: str, forbidden: tuple[str, ...]) -> None:
    bad = {f: sorted(n for n in names if n.startswith(forbidden)) for f, names in _imports(folder).items()}
    assert not {f: n for f, n in bad.items() if n}, bad
