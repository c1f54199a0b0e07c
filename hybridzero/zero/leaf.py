"""ZeRO-3 leaf modules: a module whose parameters are gathered as one unit before its forward.

DeepSpeed's ``deepspeed.utils.set_z3_leaf_modules`` recipe (MoE: Mixtral, Qwen-MoE experts, which run in a
data-dependent order, or only on some ranks): a *leaf* module is fetched whole when its forward starts, and nothing
inside it is fetched on its own. hybridzero fetches parameters per gather group (:mod:`hybridzero.zero.partition`),
so a leaf module becomes exactly that: the gather groups of the blocks it contains merge into one group owned by the
leaf (a leaf inside a block, or outside every block, is already gathered whole with its block or the root).

The mark is DeepSpeed's: the module's ``_z3_leaf`` attribute (a bool on the ``nn.Module``, which Transformers and
user code read through :func:`z3_leaf_module`; nothing is stored on tensors). It is read once, when ``initialize``
plans the gather groups: marking after ``initialize`` changes nothing for that engine. The config's
``zero_optimization.leaf_module`` block (classes, names, name suffixes) marks modules at ``initialize``.

All functions are pure but for the mark they set; they return the modules they matched, in ``model.modules()``
order, each once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

__all__ = [
    "apply_leaf_config",
    "get_z3_leaf_modules",
    "leaf_module_names",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

_MARK = "_z3_leaf"


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether ``module`` is marked as a ZeRO-3 leaf."""
    return bool(getattr(module, _MARK, False))


def z3_leaf_parameter(param: nn.Parameter) -> bool:
    """DeepSpeed's per-parameter flag: hybridzero marks modules only, so a parameter never carries it (False)."""
    del param
    return False


def set_z3_leaf_module(module: nn.Module, flag: bool) -> None:
    """Mark (or unmark) one module."""
    setattr(module, _MARK, bool(flag))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """Every marked module of ``model`` (itself included), in ``model.modules()`` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def _class_matches(module: nn.Module, spec: type | str) -> bool:
    """A class matches by ``isinstance``; a string by the class's name or its fully qualified name."""
    if isinstance(spec, type):
        return isinstance(module, spec)
    cls = type(module)
    return spec in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _mark_classes(
    model: nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool
) -> list[nn.Module]:
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf module classes must be classes or class names, got {bad!r}")
    matched = [m for m in model.modules() if any(_class_matches(m, c) for c in classes)]
    if not matched and raise_if_not_found:
        raise ValueError(f"no module of the classes {list(classes)!r} in the model ({type(model).__name__})")
    for m in matched:
        set_z3_leaf_module(m, flag)
    return matched


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark every module of ``model`` that is an instance of one of ``leaf_module_classes`` (classes, or class names
    short or fully qualified); ``ValueError`` when none matches and ``raise_if_not_found``."""
    return _mark_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Unmark the modules :func:`set_z3_leaf_modules` would mark; returns them."""
    return _mark_classes(model, leaf_module_classes, False, raise_if_not_found)


def _mark_where(
    model: nn.Module, keys: Iterable[str], hit: str, flag: bool, raise_if_not_found: bool
) -> tuple[list[nn.Module], list[str]]:
    named = list(model.named_modules())
    matched: dict[int, nn.Module] = {}
    missing: list[str] = []
    for k in keys:
        found = [m for name, m in named if (name == k if hit == "name" else name.endswith(k))]
        if not found:
            missing.append(k)
        for m in found:
            set_z3_leaf_module(m, flag)
            matched.setdefault(id(m), m)
    if missing and raise_if_not_found:
        what = "named" if hit == "name" else "with names ending in"
        raise ValueError(f"no module {what} {missing!r} in the model ({type(model).__name__})")
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(matched.values(), key=lambda m: order[id(m)]), missing


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules whose ``named_modules()`` name is in ``module_names``; returns ``(matched, missing)``."""
    return _mark_where(model, module_names, "name", flag, raise_if_not_found)


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules whose ``named_modules()`` name ends with one of the suffixes; ``(matched, missing)``."""
    return _mark_where(model, module_name_suffixes, "suffix", flag, raise_if_not_found)


def apply_leaf_config(
    model: nn.Module, classes: Sequence[str], names: Sequence[str], suffixes: Sequence[str]
) -> list[nn.Module]:
    """The ``zero_optimization.leaf_module`` block: mark by class, name and suffix, none of them required to match
    (the default classes name MoE blocks most models lack). Returns the modules marked, each once."""
    marked = set_z3_leaf_modules(model, list(classes), raise_if_not_found=False) if classes else []
    marked += set_z3_leaf_modules_by_name(model, list(names), raise_if_not_found=False)[0]
    marked += set_z3_leaf_modules_by_suffix(model, list(suffixes), raise_if_not_found=False)[0]
    return list({id(m): m for m in marked}.values())


def leaf_module_names(model: nn.Module) -> list[str]:
    """Qualified names of the marked modules of ``model`` (``""`` for ``model`` itself), outermost only: a leaf
    inside another leaf is gathered with it."""
    names = [name for name, m in model.named_modules() if z3_leaf_module(m)]
    return [n for n in names if not any(_inside(n, outer) for outer in names if outer != n)]


def _inside(name: str, outer: str) -> bool:
    """Whether module ``name`` is ``outer`` or below it."""
    return outer == "" or name == outer or name.startswith(outer + ".")
