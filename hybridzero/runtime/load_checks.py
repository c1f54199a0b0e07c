"""Type, shape and range checks on every value a checkpoint load will apply (the verification phase).

A forger who rewrites the manifest controls every value in ``state.json`` and the rank files. The checks here run
on every rank before anything is applied (:mod:`hybridzero.runtime.checkpointing` agrees on their outcome), so a
value that passes them can be applied without raising and leaves an engine that trains: a forger may choose
values, never a half-applied load or a crash at the next ``step()``.

Invariants:
* Pure functions of the saved value and the engine's current value of the same thing; nothing is modified (RNG
  states are tried on throwaway generators). Each raises ``ValueError`` naming the value's path, what was found
  and what is valid.
* A saved value has the *kind* of the current one (:func:`check_like`): None for None, a str for a str, bool for
  bool, int for int (|v| < 2**63),
  a finite number for a float, a list/tuple of the same length, a dict with the same keys, a tensor of the same
  dtype and shape; a few named values also have a range (``lr >= 0``, ``0 <= betas < 1``, ...).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybridzero.optim.loss_scaler import LossScaler

INT_LIMIT = 2**63
_RANGES: Mapping[str, tuple[float, float]] = {
    # [lo, hi): every number under a key of this name (list elements included) must lie in it
    "lr": (0.0, math.inf),
    "initial_lr": (0.0, math.inf),
    "base_lrs": (0.0, math.inf),
    "min_lrs": (0.0, math.inf),
    "max_lrs": (0.0, math.inf),
    "_last_lr": (0.0, math.inf),
    "eps": (0.0, math.inf),
    "weight_decay": (0.0, math.inf),
    "momentum": (0.0, math.inf),
    "dampening": (0.0, math.inf),
    "betas": (0.0, 1.0),
    "_step_count": (0.0, math.inf),
    "last_epoch": (-1.0, math.inf),
    "last_batch_iteration": (-1.0, math.inf),
    "step": (0.0, math.inf),
    "good_steps": (0.0, math.inf),
    "hysteresis_left": (1.0, math.inf),
}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _show(v: Any) -> str:
    text = repr(v) if not isinstance(v, torch.Tensor) else f"tensor(dtype={v.dtype}, shape={list(v.shape)})"
    return text if len(text) <= 80 else text[:77] + "..."


def _in_range(v: float, key: str, where: str) -> None:
    lo, hi = _RANGES.get(key, (-math.inf, math.inf))
    if not lo <= v < hi:
        raise ValueError(f"{where} = {_show(v)} is out of range: valid is [{lo}, {hi})")


def check_scalar(value: Any, where: str, key: str = "") -> Any:
    """``value`` if it is None, a bool, a str, an int with |v| < 2**63 or a finite float (in ``key``'s range)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int) and abs(value) >= INT_LIMIT:
        raise ValueError(f"{where} = {_show(value)} is out of range: integers must have |v| < 2**63")
    if not _number(value) or not math.isfinite(value):
        raise ValueError(f"{where} = {_show(value)} must be None, a bool, a string or a finite number")
    _in_range(value, key, where)
    return value


def check_like(value: Any, ref: Any, where: str, key: str = "") -> Any:
    """``value`` checked to have the kind of ``ref`` (see the module docstring), containers rebuilt as ``ref``'s
    type; ``key`` (the innermost dict key) selects a range. ValueError naming ``where`` otherwise."""
    if isinstance(ref, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{where} = {_show(value)} must be a bool (like the engine's {ref!r})")
        return value
    if _number(ref):
        want = "an integer" if isinstance(ref, int) else "a number"
        if not _number(value) or (isinstance(ref, int) and not isinstance(value, int)):
            raise ValueError(f"{where} = {_show(value)} must be {want} (like the engine's {ref!r})")
        if isinstance(ref, float) and not math.isfinite(ref):  # e.g. a plateau scheduler's ``best = inf``
            if isinstance(value, int) and abs(value) >= INT_LIMIT:
                raise ValueError(f"{where} = {_show(value)} is out of range: integers must have |v| < 2**63")
            return float(value)
        check_scalar(value, where, key)
        return float(value) if isinstance(ref, float) else value
    if ref is None:
        if value is not None:
            raise ValueError(f"{where} = {_show(value)} must be None (like the engine's)")
        return value
    if isinstance(ref, str):
        if not isinstance(value, str):
            raise ValueError(f"{where} = {_show(value)} must be a string (like the engine's {ref!r})")
        return value
    if isinstance(ref, torch.Tensor):
        if not isinstance(value, torch.Tensor) or value.dtype != ref.dtype or value.shape != ref.shape:
            raise ValueError(f"{where} = {_show(value)} must be a tensor like the engine's {_show(ref)}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{where} holds non-finite values")
        return value
    if isinstance(ref, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(ref):
            raise ValueError(f"{where} = {_show(value)} must be a list of {len(ref)} values (like {_show(ref)})")
        return type(ref)(check_like(v, r, f"{where}[{i}]", key) for i, (v, r) in enumerate(zip(value, ref)))
    if isinstance(ref, dict):
        if not isinstance(value, dict) or set(value) != set(ref):
            got = sorted(map(str, value)) if isinstance(value, dict) else _show(value)
            raise ValueError(f"{where} has keys {got}, the engine's has {sorted(map(str, ref))}")
        return {k: check_like(value[k], r, f"{where}[{k!r}]", k if isinstance(k, str) else key) for k, r in ref.items()}
    raise ValueError(f"{where}: the engine's value is a {type(ref).__name__}, which a checkpoint cannot restore")


def check_state(what: str, saved: Any, current: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Scheduler or loss-scaler state: the same keys as the engine's, each value of the same kind."""
    if saved is None:
        raise ValueError(
            f"{where}: no {what} state saved (load with load_lr_scheduler_states=False to keep the engine's)"
        )
    if not isinstance(saved, dict) or set(saved) != set(current):
        got = sorted(map(str, saved)) if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"{where}: {what} state has keys {got}, the engine's has {sorted(current)}")
    return {k: check_like(saved[k], v, f"{where}: {what} '{k}'", k) for k, v in current.items()}


def check_loss_scaler(saved: Any, scaler: LossScaler, where: str) -> dict[str, Any]:
    """Loss-scaler state of the right kinds that also satisfies the scaler's invariants (tried on a throwaway)."""
    state = check_state("loss scaler", saved, scaler.state_dict(), where)
    try:
        LossScaler(scaler.config).load_state_dict(state)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{where}: loss scaler state {state}: {exc}") from exc
    return state


def check_hyperparameters(
    saved: Sequence[Mapping[str, Any]], current: Sequence[Mapping[str, Any]], where: str
) -> list[dict[str, Any]]:
    """Per param group: numbers of the kind and range of the engine's, flags (bool, str, None) equal to the
    engine's (a different ``amsgrad``/``capturable``/``fused`` would break the next ``step()``); keys the engine's
    optimizer lacks must be plain scalars. Keys not saved keep the engine's value."""
    out = []
    for i, (pg, cur) in enumerate(zip(saved, current)):
        group: dict[str, Any] = {}
        for k, v in pg.items():
            at = f"{where} param group {i} '{k}'"
            if k == "params":
                continue
            if k not in cur:
                group[k] = check_scalar(v, at, k)
            elif cur[k] is None or isinstance(cur[k], (bool, str)):
                if v != cur[k] or type(v) is not type(cur[k]):
                    raise ValueError(
                        f"{at} = {_show(v)}, the engine's optimizer has {cur[k]!r}; load with "
                        "load_optimizer_states=False to keep the engine's optimizer"
                    )
                group[k] = v
            else:
                group[k] = check_like(v, cur[k], at, k)
        out.append(group)
    return out


def check_other_value(value: Any, on_device: Any, key: str, ref: Any, where: str) -> None:
    """One non-element optimizer state value (``step``, counters, ...): a finite real tensor or a scalar; ``step``
    holds one non-negative number; like the engine's current value ``ref`` when it has one."""
    if not isinstance(on_device, bool):
        raise ValueError(f"{where} 'on_param_device' = {_show(on_device)} must be a bool")
    if ref is not None:
        check_like(value, ref, f"{where} '{key}'", key)
    if isinstance(value, torch.Tensor):
        if value.is_complex() or (value.is_floating_point() and not bool(torch.isfinite(value).all())):
            raise ValueError(f"{where} '{key}' = {_show(value)} must be a finite real tensor")
        if key == "step" and (value.numel() != 1 or value.dtype == torch.bool or float(value.reshape(-1)[0]) < 0):
            raise ValueError(f"{where} 'step' = {_show(value)} must hold one number >= 0")
        return
    check_scalar(value, f"{where} '{key}'", key)
    if key == "step" and not _number(value):
        raise ValueError(f"{where} 'step' = {_show(value)} must be a number >= 0")


def check_rng(tensors: Mapping[str, Any], python_rng: Any, where: str) -> None:
    """A rank's RNG: ``rng/torch`` (and ``rng/cuda/0..n-1``) uint8 vectors each accepted by a throwaway generator
    of its device, and a Python ``random`` state accepted by a throwaway ``random.Random``."""
    n_cuda = sum(k.startswith("rng/cuda/") for k in tensors)
    expected = {"rng/torch"} | {f"rng/cuda/{i}" for i in range(n_cuda)}
    if set(tensors) != expected:
        raise ValueError(f"{where}: RNG tensors {sorted(tensors)}, expected {sorted(expected)}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
            raise ValueError(f"{where}: RNG state '{name}' = {_show(t)} must be a 1-D uint8 tensor")
    generators = {"rng/torch": "cpu"} | {f"rng/cuda/{i}": f"cuda:{i}" for i in range(n_cuda)}
    if n_cuda and torch.cuda.is_available() and n_cuda > torch.cuda.device_count():
        raise ValueError(f"{where}: {n_cuda} CUDA RNG states for {torch.cuda.device_count()} devices")
    for name, device in generators.items():
        if device != "cpu" and not torch.cuda.is_available():
            continue  # not restored without CUDA (see apply_load)
        try:
            torch.Generator(device=device).set_state(tensors[name].clone())
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"{where}: RNG state '{name}' ({tensors[name].numel()} bytes) rejected: {exc}") from exc
    try:
        random.Random().setstate(python_rng)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{where}: python RNG state {_show(python_rng)} rejected: {exc}") from exc
