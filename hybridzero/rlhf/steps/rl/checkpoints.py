"""Checkpoints of the step-3 roles that train (actor, critic, EMA) and resuming from the newest complete iteration.

Layout under ``output_dir/checkpoints``::

    <role>/iter<N>/            each role's engine checkpoint (``engine.save_checkpoint(dir, tag="iter<N>")``)
    complete/iter<N>.json      {"iteration": N, "roles": {"actor": "iter<N>", ...}}, written last

Invariant: a marker exists only for an iteration that **every** role saved completely. The roles save one after
the other (each save is atomic and ends with a barrier); only then rank 0 writes the marker atomically (temporary
file, fsync, rename). A run killed at any moment (between the actor's and the critic's save, say) leaves at most an
unmarked newer iteration, which resume ignores: it loads the newest iteration whose marker names every role of
this run, each role with its explicit tag (never the engines' ``latest``), and the interrupted iteration is run
and saved again. Markers are read as untrusted JSON: an iteration is a non-negative int, a tag must be exactly the
one this module would write, so nothing read from disk can point outside the role's directory.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from hybridzero.runtime.engine import Engine

__all__ = ["MARKER_DIR", "RoleCheckpoints", "complete_iterations", "iteration_tag"]

MARKER_DIR = "complete"
_MARKER_NAME = re.compile(r"iter(\d{1,12})\.json")


def iteration_tag(iteration: int) -> str:
    """The checkpoint tag of an iteration: ``iter<N>``."""
    return f"iter{int(iteration)}"


def _read_marker(path: Path, iteration: int) -> dict[str, str] | None:
    """The marker's ``{role: tag}`` when the file is a well-formed marker of ``iteration``, else ``None``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or data.get("iteration") != iteration or not isinstance(data.get("roles"), dict):
        return None
    roles = data["roles"]
    if not all(isinstance(k, str) and v == iteration_tag(iteration) for k, v in roles.items()):
        return None
    return roles


def complete_iterations(root: Path, roles: Mapping[str, object]) -> list[int]:
    """Iterations (ascending) whose marker names every role in ``roles`` and whose role directories exist."""
    marker_dir = root / MARKER_DIR
    if not marker_dir.is_dir():
        return []
    out = []
    for path in marker_dir.iterdir():
        match = _MARKER_NAME.fullmatch(path.name)
        if match is None:
            continue
        iteration = int(match.group(1))
        saved = _read_marker(path, iteration)
        if saved is None or not set(roles) <= set(saved):
            continue
        if all((root / name / iteration_tag(iteration)).is_dir() for name in roles):
            out.append(iteration)
    return sorted(out)


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync and rename (readers see all or nothing)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class RoleCheckpoints:
    """Saves and restores a set of named engines together (every rank calls every method)."""

    def __init__(self, root: Path, engines: Mapping[str, Engine]) -> None:
        if not engines:
            raise ValueError("RoleCheckpoints needs at least one engine")
        self.root = root
        self.engines = dict(engines)
        self._comm = next(iter(self.engines.values())).comm

    def save(self, iteration: int) -> None:
        """Checkpoint every role at ``iteration``, then mark the iteration complete (rank 0, atomically, last)."""
        tag = iteration_tag(iteration)
        for name, engine in self.engines.items():
            engine.save_checkpoint(str(self.root / name), tag=tag, client_state={"iteration": iteration})
        if self._comm.rank == 0:
            (self.root / MARKER_DIR).mkdir(parents=True, exist_ok=True)
            marker = {"iteration": iteration, "roles": dict.fromkeys(self.engines, tag)}
            _write_atomic(self.root / MARKER_DIR / f"{tag}.json", json.dumps(marker, indent=1) + "\n")
        self._comm.barrier(phase="checkpoint")

    def resume(self, echo: Callable[[str], None]) -> int:
        """Load every role at the newest complete iteration; returns it (0 when there is none: a fresh start).

        Rank 0's view of the markers decides for every rank, so ranks cannot pick different iterations.
        """
        mine = complete_iterations(self.root, self.engines)
        newest = self._comm.all_gather_object(mine[-1] if mine else 0, phase="checkpoint")[0]
        if newest == 0:
            if (self.root / "actor").is_dir():
                echo(f"{self.root}: no iteration saved completely by every role; starting from iteration 0")
            return 0
        tag = iteration_tag(newest)
        for name, engine in self.engines.items():
            path, client = engine.load_checkpoint(str(self.root / name), tag=tag)
            if path is None or not isinstance(client, dict) or "iteration" not in client:
                raise ValueError(
                    f"{self.root / name / tag}: the completion marker names it, but it holds no "
                    "checkpoint of this run (removed or replaced?); delete the marker to resume earlier"
                )
            if int(client["iteration"]) != newest:
                raise ValueError(f"{self.root / name / tag}: holds iteration {client['iteration']}, expected {newest}")
        echo(f"resumed from {self.root} at iteration {newest} ({', '.join(self.engines)})")
        return newest
