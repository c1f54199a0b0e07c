"""Completion markers of multi-role step-3 checkpoints (hybridzero.rlhf.steps.rl.checkpoints): which iterations count as
saved by every role, and that markers read from disk are treated as untrusted."""

from __future__ import annotations

import json
from pathlib import Path

from hybridzero.rlhf.steps.rl.checkpoints import MARKER_DIR, complete_iterations, iteration_tag

ROLES = {"actor": None, "critic": None, "ema": None}


def _save(root: Path, iteration: int, roles: dict[str, object], marker: object | None = "auto") -> None:
    """Role directories for ``iteration`` and (unless ``marker`` is None) its marker."""
    tag = iteration_tag(iteration)
    for name in roles:
        (root / name / tag).mkdir(parents=True, exist_ok=True)
    if marker is None:
        return
    (root / MARKER_DIR).mkdir(parents=True, exist_ok=True)
    body = {"iteration": iteration, "roles": dict.fromkeys(roles, tag)} if marker == "auto" else marker
    (root / MARKER_DIR / f"{tag}.json").write_text(json.dumps(body))


def test_only_iterations_every_role_completed(tmp_path: Path) -> None:
    assert complete_iterations(tmp_path, ROLES) == []
    _save(tmp_path, 2, ROLES)
    _save(tmp_path, 4, ROLES)
    _save(tmp_path, 6, {"actor": None}, marker=None)  # killed after the actor's save: no marker
    assert complete_iterations(tmp_path, ROLES) == [2, 4]
    _save(tmp_path, 8, {"actor": None, "critic": None})  # a marker of a run without the EMA role
    assert complete_iterations(tmp_path, ROLES) == [2, 4]
    assert complete_iterations(tmp_path, {"actor": None, "critic": None}) == [2, 4, 8]


def test_a_marker_without_its_role_directories_does_not_count(tmp_path: Path) -> None:
    _save(tmp_path, 2, ROLES)
    (tmp_path / "critic" / "iter2").rmdir()
    assert complete_iterations(tmp_path, ROLES) == []


def test_hostile_or_broken_markers_are_ignored(tmp_path: Path) -> None:
    _save(tmp_path, 2, ROLES)
    _save(tmp_path, 3, ROLES, marker={"iteration": 3, "roles": dict.fromkeys(ROLES, "../../elsewhere")})
    _save(tmp_path, 4, ROLES, marker={"iteration": 5, "roles": dict.fromkeys(ROLES, "iter4")})  # wrong iteration
    _save(tmp_path, 6, ROLES, marker=["not", "an", "object"])
    (tmp_path / MARKER_DIR / "iter7.json").write_bytes(b"\xff\xfe{")  # not UTF-8 / JSON
    (tmp_path / MARKER_DIR / "iter8.json.tmp").write_text("{}")  # a rename that never happened
    (tmp_path / MARKER_DIR / "../iter9.json").write_text("{}")  # outside the marker directory
    assert complete_iterations(tmp_path, ROLES) == [2]
