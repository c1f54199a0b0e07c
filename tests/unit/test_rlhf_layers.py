"""The RL code's rooms (issue 29, item 9) and the package's import graph: no import cycle anywhere in
``hybridzero/``, and inside ``hybridzero/rlhf/`` every import points down the rooms' order

    settings, algorithms/, runlog/  <  data/  <  lora, models  <  engines  <  rewards/  <  rollout/  <  steps/
    <  demo/  <  cli

(a module imports modules of its own room or of a lower rank, never a higher one; rooms of one rank do not import
each other). ``rlhf/__init__.py`` is the package's face (it re-exports the steps and the math) and is checked for
cycles only. The graph is read from the source (``ast``), imports under ``TYPE_CHECKING`` and lazy imports inside
functions included; ``from P import N`` counts as an import of module ``P.N`` when that module exists."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hybridzero"

RLHF = "hybridzero.rlhf"
# Each room of hybridzero/rlhf (its first name under rlhf/) and its rank: imports go from higher to lower ranks.
RANKS: dict[str, int] = {
    "settings": 0,
    "algorithms": 0,
    "runlog": 0,
    "data": 1,
    "lora": 2,
    "models": 2,
    "engines": 3,
    "rewards": 4,
    "rollout": 5,
    "steps": 6,
    "demo": 7,
    "cli": 8,
}


def _module_name(file: Path) -> str:
    parts = list(file.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(file): file for file in sorted(PACKAGE.rglob("*.py"))}


def _imported(name: str, file: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``hybridzero`` that ``name`` (read from ``file``) imports."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {n for n in out if n in modules and n != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, file, modules) for name, file in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _room(name: str) -> str:
    return name[len(RLHF) + 1 :].split(".")[0]


def test_cycle_finder_finds_a_cycle() -> None:
    """The finder itself: a loop of three and a self-contained pair are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert sorted(_cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_reads_every_import_form() -> None:
    """Absolute, relative, ``from package import module`` and lazy imports all become edges."""
    graph = _graph()
    assert f"{RLHF}.data.records" in graph[f"{RLHF}.data"]  # the face of data/ re-exports its modules
    assert f"{RLHF}.cli" in graph["hybridzero.cli"]
    assert "hybridzero.config.errors" in graph["hybridzero.config.base"]  # `from .errors import ...`


def test_no_import_cycle_in_the_package() -> None:
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles (modules that import each other in a loop): {cycles}"


def test_every_rlhf_module_has_a_room() -> None:
    """A new file of rlhf/ goes into one of the rooms (or, if it is a new room, into RANKS with its rank)."""
    unplaced = sorted(n for n in _graph() if n.startswith(f"{RLHF}.") and _room(n) not in RANKS)
    assert not unplaced, f"modules outside the rooms of hybridzero/rlhf (add them to a room): {unplaced}"


def test_rlhf_imports_point_down_the_rooms() -> None:
    bad = []
    for name, targets in _graph().items():
        if not name.startswith(f"{RLHF}."):
            continue
        for target in sorted(targets):
            if target == RLHF:
                bad.append(f"{name} imports the package face {RLHF}")
            elif target.startswith(f"{RLHF}.") and _room(target) != _room(name):
                if RANKS[_room(target)] >= RANKS[_room(name)]:
                    bad.append(f"{name} ({_room(name)}) imports {target} ({_room(target)})")
    assert not bad, "imports that run up or across the rooms of hybridzero/rlhf:\n" + "\n".join(bad)


def test_only_the_cli_imports_the_rlhf_pipeline() -> None:
    """The engine's layers never import the RL code; ``hybridzero/cli.py`` (the commands) is its one user."""
    users = sorted(
        n for n, targets in _graph().items() if not n.startswith(RLHF) and any(t.startswith(RLHF) for t in targets)
    )
    assert users == ["hybridzero.cli"]
