"""The one argument check DeepSpeed's CPU optimizer classes share here (:mod:`hybridzero.ops.adam`, ``adagrad``,
``lion``)."""

from __future__ import annotations

__all__ = ["require_fp32_states"]


def require_fp32_states(cls_name: str, fp32_optimizer_states: bool) -> None:
    """Refuse ``fp32_optimizer_states=False`` naming the class: the state follows hybridzero's fp32 masters."""
    if not fp32_optimizer_states:
        raise ValueError(
            f"{cls_name}(fp32_optimizer_states=False) is not supported: optimizer state follows the fp32 master "
            "parameters"
        )
