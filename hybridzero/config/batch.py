"""DeepSpeed's batch-size arithmetic: ``train_batch_size = micro * gas * world_size``.

Any one or two of the three may be missing (``None``; ``"auto"`` in JSON) and is
derived; with only ``train_micro_batch_size_per_gpu`` or only
``train_batch_size`` given, ``gradient_accumulation_steps`` is 1 (as DeepSpeed).
Unlike DeepSpeed, a division that leaves a remainder is an error rather than a
silent floor, and every count (given or derived) must lie in ``[1, BATCH_LIMIT]``
(absurd values are a ConfigError naming the key, not an OverflowError later).
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError, show

__all__ = ["BATCH_KEYS", "BATCH_LIMIT", "resolve_batch_sizes"]

TBS, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
BATCH_KEYS: tuple[str, str, str] = (TBS, MICRO, GAS)
_TIP = f"set any two of {TBS}, {MICRO}, {GAS} (or all three, consistently)"
BATCH_LIMIT = 2**31 - 1  # every batch count, given or derived, fits an int32 (samples counters stay int64)


def _positive(value: Any, key: str) -> int | None:
    """``value`` if it is ``None`` or an int >= 1; otherwise a ConfigError naming ``key``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{key} = {show(value)} is invalid: expected an integer >= 1 and <= {BATCH_LIMIT}", key=key, value=value
        )
    if value < 1:
        raise ConfigError(f"{key} = {value} is invalid: it must be >= 1", key=key, value=value)
    if value > BATCH_LIMIT:
        raise ConfigError(f"{key} = {value} is invalid: it must be >= 1 and <= {BATCH_LIMIT}", key=key, value=value)
    return value


def _quotient(total: int, parts: tuple[tuple[str, int], ...], derived: str) -> int:
    """``total // product(parts)``; error naming every operand if it does not divide."""
    divisor = 1
    for _, size in parts:
        divisor *= size
    if total % divisor:
        shown = " * ".join(f"{name} ({size})" for name, size in parts)
        raise ConfigError(
            f"{TBS} = {total} is not divisible by {shown} = {divisor}, so {derived} cannot be derived; {_TIP}",
            key=TBS,
            value=total,
        )
    return total // divisor


def _check_product(tbs: int, micro: int, gas: int, world: int) -> None:
    product = micro * gas * world
    if tbs != product:
        raise ConfigError(
            f"inconsistent batch sizes: {TBS} = {tbs}, but {MICRO} ({micro}) * {GAS} ({gas}) * "
            f"world_size ({world}) = {product}; {TBS} must equal that product -- {_TIP}, "
            f'or set one to "auto" to derive it',
            key=TBS,
            value=tbs,
        )


def _derived_total(micro: int, gas: int, world: int) -> int:
    """``micro * gas * world`` when it is at most BATCH_LIMIT; else a ConfigError naming the operands."""
    total = micro * gas * world
    if total > BATCH_LIMIT:
        raise ConfigError(
            f"{TBS} = {MICRO} ({micro}) * {GAS} ({gas}) * world_size ({world}) = {total} is invalid: "
            f"it must be <= {BATCH_LIMIT}; lower {MICRO} or {GAS}",
            key=GAS,
            value=gas,
        )
    return total


def resolve_batch_sizes(
    train_batch_size: int | None, micro: int | None, gas: int | None, world_size: int
) -> tuple[int, int, int]:
    """Return ``(train_batch_size, micro, gas)`` completed by DeepSpeed's rules.

    Pure. Postcondition: all three are ints >= 1 and
    ``train_batch_size == micro * gas * world_size``. Raises ConfigError (naming the
    keys, their values and the world size) for values < 1, non-divisible
    derivations, an inconsistent triple, or when neither ``train_batch_size`` nor
    ``micro`` is given.
    """
    world = _positive(world_size, "world_size")
    if world is None:
        raise ConfigError("world_size = null is invalid: expected an integer >= 1", key="world_size")
    tbs, mbs, acc = _positive(train_batch_size, TBS), _positive(micro, MICRO), _positive(gas, GAS)
    if tbs is not None and mbs is not None and acc is not None:
        _check_product(tbs, mbs, acc, world)
        return tbs, mbs, acc
    if tbs is not None and mbs is not None:
        return tbs, mbs, _quotient(tbs, ((MICRO, mbs), ("world_size", world)), GAS)
    if tbs is not None and acc is not None:
        return tbs, _quotient(tbs, ((GAS, acc), ("world_size", world)), MICRO), acc
    if mbs is not None:
        acc = 1 if acc is None else acc
        return _derived_total(mbs, acc, world), mbs, acc
    if tbs is not None:
        return tbs, _quotient(tbs, (("world_size", world),), f"{MICRO} (with {GAS} = 1)"), 1
    given = f" (only {GAS} = {acc} was given)" if acc is not None else ""
    raise ConfigError(
        f"batch size is not specified{given}: set {TBS} or {MICRO}; "
        '"auto" is filled in by the Hugging Face Trainer, and there is none here',
        key=TBS,
    )
