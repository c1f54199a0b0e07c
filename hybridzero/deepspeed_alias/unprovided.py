"""How the ``deepspeed`` alias fails for DeepSpeed names hybridzero does not provide: always naming the name.

* A module-level name a served module lacks: :func:`missing_attribute` (the module's ``__getattr__`` raises it).
* A DeepSpeed function whose behaviour hybridzero does not have: :func:`unprovided` gives a stand-in that raises
  ``NotImplementedError`` naming it and why, when called (so importing it, as integrations do up front, works).
* A DeepSpeed class hybridzero does not have (pipeline parallelism, MoE layers, DeepSpeed's internal optimizer
  wrappers): :func:`unprovided_class` gives a class that can be imported, subclassed and used in ``isinstance``
  (nothing hybridzero builds is an instance of it) but raises ``NotImplementedError`` naming it when instantiated.
* A ``deepspeed.*`` module the alias does not serve: ``ModuleNotFoundError`` naming it (see ``finder.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["missing_attribute", "unprovided", "unprovided_class"]


def missing_attribute(module: str, name: str) -> AttributeError:
    """The error for ``module.name`` that the alias does not provide."""
    if name.startswith("__") and name.endswith("__"):
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    return AttributeError(
        f"{module}.{name} is not provided by hybridzero's deepspeed alias (DeepSpeed is not installed; hybridzero "
        f"serves `import deepspeed`). See hybridzero/deepspeed_alias/tree/ for what each module provides"
    )


def unprovided(name: str, why: str) -> Callable[..., NoReturn]:
    """A stand-in for DeepSpeed's ``name`` that raises ``NotImplementedError`` naming it and ``why`` when called."""

    def fail(*args: Any, **kwargs: Any) -> NoReturn:
        del args, kwargs
        raise NotImplementedError(f"{name} is not provided by hybridzero's deepspeed alias: {why}")

    fail.__name__ = fail.__qualname__ = name.rsplit(".", 1)[-1]
    fail.__doc__ = f"Not provided by hybridzero: {why}."
    return fail


def unprovided_class(name: str, why: str) -> type:
    """A stand-in class for DeepSpeed's ``name``: importable and subclassable; instantiating it (or a subclass)
    raises ``NotImplementedError`` naming it and ``why``."""

    def refuse(self: object, *args: Any, **kwargs: Any) -> None:
        del self, args, kwargs
        raise NotImplementedError(f"{name} is not provided by hybridzero's deepspeed alias: {why}")

    short = name.rsplit(".", 1)[-1]
    namespace = {
        "__init__": refuse,
        "__doc__": f"Not provided by hybridzero: {why}.",
        "__module__": name.rsplit(".", 1)[0],
    }
    return type(short, (), namespace)
