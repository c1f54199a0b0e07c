"""The engine's optimizer state in checkpoint coordinates: capture for saving, staging for loading.

A *leaf* is the optimizer's view of one param group's part of a gather group's master (the tensors in
``optimizer.param_groups[k]["params"]``). Its state splits in two:

* *per-element* state (``exp_avg``, ...): a floating tensor of the leaf's shape (``step`` never is). Saved in the
  coordinates of the group's flat buffer, so it reshards with the master.
* everything else (a 0-dim or shape-[1] ``step``, integer counters, multi-element tensors, Python numbers): saved
  per optimizer param group (the first leaf's value, as every leaf of a group steps together) with its exact
  shape and dtype, and whether it lived on the parameter's device (``capturable``/``fused`` Adam).

Invariant: staging reads and checks everything and returns new state objects; nothing is written to the
optimizer until :func:`apply_optimizer_state`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from hybridzero.checkpoint.format import DTYPES, SavedSource, SavedTag, dtype_name
from hybridzero.runtime.load_checks import check_hyperparameters, check_other_value
from hybridzero.zero.fill import read_range
from hybridzero.zero.groups import ShardedGroup

LeafRange = tuple[int, torch.Tensor, ShardedGroup, int, int]  # opt group, leaf, gather group, [a, b) in its master


def leaf_ranges(optimizer: torch.optim.Optimizer | None, groups: Sequence[ShardedGroup]) -> list[LeafRange]:
    """Every optimizer leaf with the gather group and the range of that group's (local) master it views."""
    if optimizer is None:
        return []
    by_storage = {g.master.untyped_storage().data_ptr(): g for g in groups}
    out: list[LeafRange] = []
    for k, pg in enumerate(optimizer.param_groups):
        for leaf in pg["params"]:
            g = by_storage[leaf.untyped_storage().data_ptr()]
            a = leaf.storage_offset() - g.master.storage_offset()
            out.append((k, leaf, g, a, a + leaf.numel()))
    return out


def is_per_element(key: str, value: Any, leaf: torch.Tensor) -> bool:
    """True for state stored per element (see the module docstring)."""
    return isinstance(value, torch.Tensor) and key != "step" and value.is_floating_point() and value.shape == leaf.shape


def capture_per_element(
    optimizer: torch.optim.Optimizer | None, groups: Sequence[ShardedGroup], ranges: Mapping[str, tuple[int, int]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Per saved group name: each per-element state key as a tensor over the group's saved range ``[lo, hi)``."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    state = optimizer.state if optimizer is not None else {}
    for _, leaf, g, a, b in leaf_ranges(optimizer, groups):
        if g.name not in ranges:
            continue
        lo, hi = ranges[g.name]
        for key, t in state.get(leaf, {}).items():
            if not is_per_element(key, t, leaf):
                continue
            if dtype_name(t.dtype) not in DTYPES:
                raise TypeError(f"optimizer state '{key}' has dtype {t.dtype}; checkpoints store {sorted(DTYPES)}")
            buf = out.setdefault(g.name, {}).setdefault(key, torch.zeros(hi - lo, dtype=t.dtype))
            buf[a:b].copy_(t.detach().cpu())
    return out


def capture_other(optimizer: torch.optim.Optimizer | None, groups: Sequence[ShardedGroup]) -> dict[str, Any]:
    """Per optimizer group index (a str): ``{key: {"value": v, "on_param_device": bool}}`` of non-element state."""
    out: dict[str, dict[str, Any]] = {}
    if optimizer is None:
        return out
    for k, leaf, _, _, _ in leaf_ranges(optimizer, groups):
        for key, v in optimizer.state.get(leaf, {}).items():
            if is_per_element(key, v, leaf) or key in out.get(str(k), {}):
                continue
            on_device = isinstance(v, torch.Tensor) and v.device == leaf.device and leaf.device.type != "cpu"
            value = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
            out.setdefault(str(k), {})[key] = {"value": value, "on_param_device": on_device}
    return out


def hyperparameters(optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    """Every param group's settings without its parameters."""
    if optimizer is None:
        return []
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _saved_keys(tag: SavedTag) -> dict[str, dict[str, str]]:
    """Per saved group: per-element state keys (not ``master``) with their dtypes, over all ranks."""
    out: dict[str, dict[str, str]] = {}
    for entry in tag.meta["ranks"]:
        for g, part in entry.items():
            out.setdefault(g, {}).update({k: d for k, d in part["keys"].items() if k != "master"})
    return out


def _keys_for(
    by_alias: Mapping[str, str],
    g: ShardedGroup,
    lo: int,
    hi: int,
    aliases: Mapping[str, Sequence[str]],
    keys: Mapping[str, Mapping[str, str]],
) -> dict[str, str]:
    """Per-element keys saved for any parameter overlapping flat range ``[lo, hi)`` of ``g`` (``by_alias``: saved
    parameter name -> saved group)."""
    out: dict[str, str] = {}
    for spec in g.layout.specs:
        if spec.offset < hi and lo < spec.end:
            group = next((by_alias[a] for a in aliases.get(spec.name, (spec.name,)) if a in by_alias), None)
            out.update(keys.get(group, {}) if group is not None else {})
    return out


def stage_optimizer_state(
    optimizer: torch.optim.Optimizer,
    groups: Sequence[ShardedGroup],
    rank: int,
    tag: SavedTag,
    saved: Any,
    aliases: Mapping[str, Sequence[str]],
    missing: Collection[str],
) -> tuple[dict[torch.Tensor, dict[str, Any]], list[dict[str, Any]]]:
    """New state per leaf and new hyperparameters per group, read and checked; the optimizer is not touched."""
    where = f"{tag.path}/state.json: optimizer"
    if not isinstance(saved, dict) or not {"class", "param_groups", "state"} <= set(saved):
        raise ValueError(f"{where}: no optimizer state saved; load with load_optimizer_states=False")
    if saved["class"] != type(optimizer).__name__:
        raise ValueError(
            f"{where}: saved by {saved['class']}, the engine has {type(optimizer).__name__}; "
            "load with load_optimizer_states=False to keep the new optimizer's fresh state"
        )
    pgs = saved["param_groups"]
    if (
        not isinstance(pgs, list)
        or len(pgs) != len(optimizer.param_groups)
        or not all(isinstance(p, dict) for p in pgs)
    ):
        raise ValueError(
            f"{where}: {len(pgs) if isinstance(pgs, list) else '?'} param groups saved, the engine's "
            f"optimizer has {len(optimizer.param_groups)}"
        )
    pgs = check_hyperparameters(pgs, optimizer.param_groups, where)
    other = _check_other(optimizer, groups, saved["state"], where)
    keys = _saved_keys(tag)
    by_alias = {a: info["group"] for info in tag.meta["params"].values() for a in info["aliases"]}
    new: dict[torch.Tensor, dict[str, Any]] = {}
    for k, leaf, g, a, b in leaf_ranges(optimizer, groups):
        lo = 0 if g.master_is_whole else g.layout.shard_range(rank)[0]
        state: dict[str, Any] = {}
        for key, dtype in _keys_for(by_alias, g, lo + a, lo + b, aliases, keys).items():
            value = read_range(g.layout.specs, lo + a, lo + b, SavedSource(tag, key), aliases, skip=missing)
            state[key] = value.to(device=leaf.device, dtype=DTYPES[dtype])
        for key, entry in other.get(str(k), {}).items():
            v = entry["value"]  # a fresh copy per leaf: optimizers update tensors such as ``step`` in place
            if isinstance(v, torch.Tensor):
                v = v.clone().to(leaf.device if entry["on_param_device"] else "cpu")
            state[key] = v
        if state:
            _check_keys(optimizer, k, leaf, state, where)
            new[leaf] = state
    return new, pgs


def _check_other(
    optimizer: torch.optim.Optimizer, groups: Sequence[ShardedGroup], other: Any, where: str
) -> dict[str, dict[str, Any]]:
    """The saved non-element state: one entry per existing optimizer group index, each value checked (see
    :func:`~hybridzero.runtime.load_checks.check_other_value`) against the engine's current value if any."""
    n = len(optimizer.param_groups)
    if not isinstance(other, dict) or not set(other) <= {str(k) for k in range(n)}:
        got = sorted(map(str, other)) if isinstance(other, dict) else type(other).__name__
        raise ValueError(f"{where}: per-group state keys {got} must be group indices '0'..'{n - 1}'")
    first: dict[str, dict[str, Any]] = {}
    for k, leaf, _, _, _ in leaf_ranges(optimizer, groups):
        first.setdefault(str(k), optimizer.state.get(leaf, {}))
    for k, entries in other.items():
        if not isinstance(entries, dict):
            raise ValueError(f"{where}: group {k} state must be an object, got {type(entries).__name__}")
        for key, entry in entries.items():
            at = f"{where} group {k}"
            if not isinstance(entry, dict) or set(entry) != {"value", "on_param_device"}:
                raise ValueError(f"{at} '{key}' must be {{'value': ..., 'on_param_device': bool}}")
            check_other_value(entry["value"], entry["on_param_device"], key, first.get(k, {}).get(key), at)
    return other


def _check_keys(
    optimizer: torch.optim.Optimizer, k: int, leaf: torch.Tensor, state: Mapping[str, Any], where: str
) -> None:
    """A leaf's staged state keys are the ones its optimizer reads: the current state's when it has some, else
    Adam/AdamW's own (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with amsgrad)."""
    expected: set[str] | None = set(optimizer.state.get(leaf, {})) or None
    if expected is None and type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        amsgrad = {"max_exp_avg_sq"} if optimizer.param_groups[k].get("amsgrad") else set()
        expected = {"step", "exp_avg", "exp_avg_sq"} | amsgrad
    if expected is not None and set(state) != expected:
        raise ValueError(
            f"{where}: param group {k} has state {sorted(state)}, {type(optimizer).__name__} needs {sorted(expected)}"
        )


def apply_optimizer_state(
    optimizer: torch.optim.Optimizer, state: dict[torch.Tensor, dict[str, Any]], param_groups: list[dict[str, Any]]
) -> None:
    """Replace the optimizer's state and hyperparameters with staged ones (cannot fail on staged input)."""
    optimizer.state.clear()
    for leaf, st in state.items():
        optimizer.state[leaf] = st
    for group, saved in zip(optimizer.param_groups, param_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
