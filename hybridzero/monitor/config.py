"""The four monitor blocks of a DeepSpeed config (``tensorboard``, ``wandb``, ``csv_monitor``, ``comet``), checked.

Keys and defaults are DeepSpeed's (``deepspeed.monitor.config``): every block has ``enabled`` (default false);
``tensorboard`` and ``csv_monitor`` have ``output_path`` (default ``""``: the current directory) and ``job_name``
(default ``"DeepSpeedJobName"``); ``wandb`` has ``project`` (default ``"deepspeed"``), ``group`` and ``team``;
``comet`` has ``project``, ``workspace``, ``api_key``, ``experiment_name``, ``experiment_key``, ``online``, ``mode``
and ``samples_log_interval`` (default 100).

Invariant: a block that is present is validated whether enabled or not; an unknown key or a value of the wrong type
is a one-line :class:`~hybridzero.config.ConfigError` naming the dotted key and what would be valid. Pure: nothing
is imported or written here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridzero.config.errors import ConfigError, show

__all__ = ["BLOCKS", "EXTRAS", "MonitorBlock", "monitor_blocks"]

DEFAULT_JOB = "DeepSpeedJobName"
# block name -> {key: (accepted types, default)}
_KEYS: dict[str, dict[str, tuple[tuple[type, ...], Any]]] = {
    "tensorboard": {"enabled": ((bool,), False), "output_path": ((str,), ""), "job_name": ((str,), DEFAULT_JOB)},
    "csv_monitor": {"enabled": ((bool,), False), "output_path": ((str,), ""), "job_name": ((str,), DEFAULT_JOB)},
    "wandb": {
        "enabled": ((bool,), False),
        "project": ((str,), "deepspeed"),
        "group": ((str, type(None)), None),
        "team": ((str, type(None)), None),
    },
    "comet": {
        "enabled": ((bool,), False),
        "samples_log_interval": ((int,), 100),
        "project": ((str, type(None)), None),
        "workspace": ((str, type(None)), None),
        "api_key": ((str, type(None)), None),
        "experiment_name": ((str, type(None)), None),
        "experiment_key": ((str, type(None)), None),
        "online": ((bool, type(None)), None),
        "mode": ((str, type(None)), None),
    },
}
BLOCKS: tuple[str, ...] = tuple(_KEYS)
# block name -> (python module it needs, hybridzero extra that installs it); csv needs nothing
EXTRAS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "comet": ("comet_ml", "comet"),
}


@dataclass(frozen=True)
class MonitorBlock:
    """One enabled monitor block: its name and every key with DeepSpeed's default filled in."""

    name: str
    values: dict[str, Any] = field(default_factory=dict)


def _check(block: str, body: Any) -> dict[str, Any]:
    """``body`` with defaults filled in; ConfigError naming ``block.key`` for anything DeepSpeed would refuse."""
    keys = _KEYS[block]
    if not isinstance(body, Mapping):
        raise ConfigError(f"{block} must be an object with keys {sorted(keys)}, got {show(body)}", key=block)
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key not in keys:
            raise ConfigError(
                f"{block}.{key} is not a {block} setting; valid keys: {', '.join(sorted(keys))}",
                key=f"{block}.{key}",
                value=value,
            )
        types = keys[key][0]
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if key == "samples_log_interval" and ok and value < 1:
            ok = False
        if not ok:
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            extra = " >= 1" if key == "samples_log_interval" else ""
            raise ConfigError(f"{block}.{key} must be {names}{extra}, got {show(value)}", key=f"{block}.{key}")
        out[key] = value
    return {k: out.get(k, default) for k, (_, default) in keys.items()}


def monitor_blocks(raw: Mapping[str, Any]) -> list[MonitorBlock]:
    """The enabled monitor blocks of DeepSpeed JSON ``raw`` in DeepSpeed's order (tensorboard, csv, wandb, comet);
    every present block is checked (see the module docstring)."""
    out = []
    for block in BLOCKS:
        if block in raw:
            values = _check(block, raw[block])
            if values["enabled"]:
                out.append(MonitorBlock(block, values))
    return out
