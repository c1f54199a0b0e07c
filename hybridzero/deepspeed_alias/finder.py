"""The import machinery behind the opt-in ``deepspeed`` alias: a meta-path finder and an ``importlib.metadata``
distribution.

``deepspeed`` and every ``deepspeed.X.Y`` are served from the files of :mod:`hybridzero.deepspeed_alias.tree`
(``tree/X/Y.py`` or ``tree/X/Y/__init__.py``), executed under their DeepSpeed names. Those files only re-export
hybridzero's objects (and define the few constants DeepSpeed's integrations read), so no class exists twice:
``deepspeed.zero.Init is hybridzero.zero.Init``. A ``deepspeed.*`` module the tree does not have still resolves, to
a module whose import raises ``ModuleNotFoundError`` naming it and saying it is not provided by hybridzero.

Never shadowing a real DeepSpeed: the finder is *appended* to ``sys.meta_path``, so the standard path finder, which
finds an installed ``deepspeed`` first, always wins; the finder answers ``deepspeed.*`` only while the ``deepspeed``
in ``sys.modules`` is the alias; and the distribution is reported only while no ``deepspeed`` is findable on
``sys.path``. :func:`real_deepspeed_spec` is that check.

The distribution (``importlib.metadata.version("deepspeed")``, which transformers and accelerate read for their
minimum-version checks) says what it is: version ``DEEPSPEED_API_VERSION+hybridzero.<version>`` (the DeepSpeed
release whose API the alias follows, with hybridzero's version as the local label), summary and author naming
hybridzero.

Invariants: the finder and the distribution hold no state (what they serve is a function of the tree's files and
of ``sys.path``/``sys.modules``); installing twice installs once (see :mod:`hybridzero.deepspeed_alias`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from hybridzero import __version__

__all__ = [
    "DEEPSPEED_API_VERSION",
    "AliasDistribution",
    "DeepSpeedAliasFinder",
    "alias_version",
    "is_alias_module",
    "real_deepspeed_spec",
]

DEEPSPEED_API_VERSION = "0.19.8"
"""The DeepSpeed release whose API the alias follows (the one the project's benchmarks and tests compare with)."""

_NAME = "deepspeed"
TREE = Path(__file__).resolve().parent / "tree"
_MARK = "__hybridzero_alias__"


def alias_version() -> str:
    """``0.19.8+hybridzero.<hybridzero version>``: a PEP 440 version that satisfies DeepSpeed minimum-version
    checks and names what is really installed in its local label."""
    return f"{DEEPSPEED_API_VERSION}+hybridzero.{__version__}"


def real_deepspeed_spec() -> importlib.machinery.ModuleSpec | None:
    """The spec of a ``deepspeed`` installed on ``sys.path`` (the standard path finder's answer), or ``None``."""
    return importlib.machinery.PathFinder.find_spec(_NAME)


def is_alias_module(module: object) -> bool:
    """True if ``module`` is a module the alias served."""
    return isinstance(module, ModuleType) and bool(getattr(module, _MARK, False))


class _Unprovided(importlib.abc.Loader):
    """Loader of a ``deepspeed.*`` module hybridzero does not provide: importing it raises, naming it."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        name = module.__name__
        raise ModuleNotFoundError(
            f"{name} is not provided by hybridzero's deepspeed alias (hybridzero serves `import deepspeed` because "
            f"DeepSpeed is not installed); provided modules: {', '.join(provided_modules())}. Install DeepSpeed "
            f"for {name}, or avoid the feature that imports it",
            name=name,
        )


class _TreeLoader(importlib.machinery.SourceFileLoader):
    """Executes a tree file under its DeepSpeed name and marks the module as the alias's."""

    def exec_module(self, module: ModuleType) -> None:
        setattr(module, _MARK, True)
        super().exec_module(module)


def _tree_file(fullname: str) -> tuple[Path, bool] | None:
    """``(file, is_package)`` of the tree file serving ``fullname`` (``deepspeed`` or ``deepspeed.X...``)."""
    parts = fullname.split(".")[1:]
    base = TREE.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py", True
    if parts and base.with_suffix(".py").is_file():
        return base.with_suffix(".py"), False
    return None


def provided_modules() -> list[str]:
    """Every ``deepspeed.*`` module name the tree serves, sorted."""
    names = []
    for path in sorted(TREE.rglob("*.py")):
        rel = path.relative_to(TREE).with_suffix("").parts
        rel = rel[:-1] if rel[-1] == "__init__" else rel
        names.append(".".join((_NAME, *rel)))
    return sorted(names)


class DeepSpeedAliasFinder(importlib.abc.MetaPathFinder):
    """Serves ``deepspeed`` / ``deepspeed.*`` from the tree when no real DeepSpeed answered first (module docstring)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _NAME and not fullname.startswith(_NAME + "."):
            return None
        if fullname != _NAME and not is_alias_module(sys.modules.get(_NAME)):
            return None  # a real deepspeed (or none) is imported: its own submodules are its business
        if fullname == _NAME and real_deepspeed_spec() is not None:
            return None  # reached only if an earlier finder declined; a real one is still never shadowed
        found = _tree_file(fullname)
        if found is None:
            return importlib.machinery.ModuleSpec(fullname, _Unprovided())
        file, is_package = found
        return importlib.util.spec_from_file_location(
            fullname,
            file,
            loader=_TreeLoader(fullname, os.fspath(file)),
            submodule_search_locations=[] if is_package else None,
        )

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and name.replace("-", "_").lower() != _NAME:
            return iter(())
        if real_deepspeed_spec() is not None:
            return iter(())
        return iter((AliasDistribution(),))

    def __eq__(self, other: object) -> bool:  # any two instances are the same finder (idempotent install)
        return isinstance(other, DeepSpeedAliasFinder)

    def __hash__(self) -> int:
        return hash(DeepSpeedAliasFinder)


class AliasDistribution(importlib.metadata.Distribution):
    """``importlib.metadata``'s view of the alias: name ``deepspeed``, version :func:`alias_version`, no files."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return (
                "Metadata-Version: 2.1\n"
                f"Name: {_NAME}\n"
                f"Version: {alias_version()}\n"
                "Summary: hybridzero serving the deepspeed import name (DeepSpeed itself is not installed)\n"
                "Author: hybridzero\n"
            )
        if filename == "top_level.txt":
            return _NAME + "\n"
        return None

    def locate_file(self, path: Any) -> Path:
        return TREE / str(path)
