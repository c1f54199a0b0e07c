"""``hybridzero.runtime.zero``: the ``deepspeed.runtime.zero`` module names user code imports (the ZeRO machinery
itself lives in :mod:`hybridzero.zero`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["unwrap_model_for_generation"]


@contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """DeepSpeed's ``deepspeed.runtime.zero.unwrap_model_for_generation(engine)``: inside the block every parameter of
    the engine's model is whole (gathered once, not per module and token) and the per-module fetch is off; yields
    ``model`` (the engine, as DeepSpeed does). On exit the gathered copies are released and fetching is back on.

    This is :meth:`engine.generation_mode` (the hybrid engine's gather-once path: prefetch state is settled first, so
    no gather is left in flight, and the groups are pinned for the block) leaving every module's train/eval mode as
    it is, as DeepSpeed's does. ``model.generate(...)`` inside (the engine's hybrid generation) and
    ``model.module.generate(...)`` both decode on the gathered weights without a collective. For generation and
    no-grad forwards only: a backward inside the block is not supported (as in DeepSpeed, whose version removes the
    hooks backward needs). At ZeRO 0-2 parameters are always whole and the block
    changes nothing.
    """
    if not callable(getattr(model, "generation_mode", None)):
        raise TypeError(
            f"unwrap_model_for_generation: expected the engine deepspeed.initialize returned, got "
            f"{type(model).__name__} (pass the engine, not engine.module)"
        )
    with model.generation_mode(keep_mode=True):  # DeepSpeed's leaves every module's train/eval mode alone
        yield model
