"""Cross-field checks on the config tree.

``check_*`` functions raise :class:`ConfigError` for combinations that cannot
work; :func:`advisories` lists combinations that work but are probably not what
the user meant (they become warnings in ``load_config``). All are pure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .batch import resolve_batch_sizes
from .errors import ConfigError, show

if TYPE_CHECKING:  # pragma: no cover - typing only; schema imports this module
    from .schema import Config, FP16Config

__all__ = ["advisories", "check_batch", "check_hpz", "check_loss_scaling", "check_precision", "check_world_size"]


def check_world_size(world_size: Any) -> None:
    """``world_size`` must be an int >= 1."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(
            f"world_size = {show(world_size)} is invalid: expected an integer >= 1", key="world_size", value=world_size
        )


def check_batch(train_batch_size: int, micro: int, gas: int, world_size: int) -> None:
    """All given, >= 1, and ``train_batch_size == micro * gas * world_size``."""
    resolve_batch_sizes(train_batch_size, micro, gas, world_size)


def check_precision(fp16_enabled: bool, bf16_enabled: bool) -> None:
    """At most one of fp16 / bf16 (DeepSpeed: 'cannot be simultaneously enabled')."""
    if fp16_enabled and bf16_enabled:
        raise ConfigError(
            "fp16.enabled = true and bf16.enabled = true: at most one reduced precision can be enabled; "
            "set one of them to false",
            key="bf16.enabled",
            value=True,
        )


def check_hpz(hpz_partition_size: int, world_size: int) -> None:
    """ZeRO++ hpZ groups must tile the world: ``world_size % hpz_partition_size == 0``."""
    if world_size % hpz_partition_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(
            f"zero_optimization.zero_hpz_partition_size = {hpz_partition_size} does not divide "
            f"world_size = {world_size}; valid values: {', '.join(map(str, divisors))}",
            key="zero_optimization.zero_hpz_partition_size",
            value=hpz_partition_size,
        )


def check_loss_scaling(fp16: FP16Config) -> None:
    """With dynamic fp16 loss scaling on: window >= 1, hysteresis >= 1, min scale > 0."""
    if not (fp16.enabled and fp16.loss_scale == 0.0):
        return
    rules = (
        ("loss_scale_window", fp16.loss_scale_window, fp16.loss_scale_window >= 1, "an integer >= 1"),
        ("hysteresis", fp16.hysteresis, fp16.hysteresis >= 1, "an integer >= 1"),
        ("min_loss_scale", fp16.min_loss_scale, fp16.min_loss_scale > 0, "a number > 0"),
    )
    for name, value, ok, expected in rules:
        if not ok:
            key = f"fp16.{name}"
            raise ConfigError(
                f"{key} = {show(value)} is invalid with dynamic loss scaling (fp16.loss_scale = 0): "
                f"expected {expected}",
                key=key,
                value=value,
            )


def advisories(config: Config) -> tuple[tuple[str, str], ...]:
    """``(dotted key, message)`` pairs for settings that will have no effect."""
    zero = config.zero
    notes: list[tuple[str, str]] = []
    if zero.stage < 3 and zero.offload_param.enabled:
        key = "zero_optimization.offload_param"
        notes.append((key, f"{key}.device = '{zero.offload_param.device}' has no effect below ZeRO stage 3 "
                           f"(zero_optimization.stage = {zero.stage})"))
    zeropp = (
        ("zero_hpz_partition_size", zero.hpz_partition_size > 1, zero.hpz_partition_size),
        ("zero_quantized_weights", zero.quantized_weights, True),
        ("zero_quantized_nontrainable_weights", zero.quantized_nontrainable_weights, True),
    )
    for name, is_set, value in zeropp:
        if zero.stage < 3 and is_set:
            key = f"zero_optimization.{name}"
            notes.append((key, f"{key} = {show(value)} is a ZeRO-3 (ZeRO++) option and has no effect at "
                               f"zero_optimization.stage = {zero.stage}"))
    return tuple(notes)
