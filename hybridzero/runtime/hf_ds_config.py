"""``HfDeepSpeedConfig`` for DeepSpeed code run on hybridzero without DeepSpeed installed.

DeepSpeed's non-Trainer integration (DeepSpeed-Chat's ``create_hf_model``) builds
``transformers.integrations.deepspeed.HfDeepSpeedConfig(ds_config)`` before ``from_pretrained`` so that, at ZeRO-3,
transformers constructs the model inside ``deepspeed.zero.Init``. transformers' class refuses to exist without the
``deepspeed`` package, and registering one would make transformers import ``deepspeed`` inside ``from_pretrained``.

This class answers the same queries (``is_zero3()``, ``get_value("zero_optimization.stage")``, ...) over the
same config and registers nothing anywhere: ``from_pretrained`` then builds the model whole on each rank and
``hybridzero.initialize`` shards it (for models that fit one rank's host memory; build larger ones inside
``hybridzero.zero.Init`` yourself). Difference from transformers': no process-global weak reference is set, so
``transformers.integrations.is_deepspeed_zero3_enabled()`` stays False.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["HfDeepSpeedConfig"]


class HfDeepSpeedConfig:
    """A DeepSpeed config (a dict or a JSON file path) with transformers' / accelerate's query methods.

    Invariant: ``config`` is a private deep copy; queries never change it (``del_config_sub_tree`` is the one
    mutator, as in accelerate)."""

    def __init__(self, config_file_or_dict: Mapping[str, Any] | str | Path) -> None:
        if isinstance(config_file_or_dict, Mapping):
            config = copy.deepcopy(dict(config_file_or_dict))
        elif Path(config_file_or_dict).is_file():
            config = json.loads(Path(config_file_or_dict).read_text())
        else:
            raise ValueError(
                f"HfDeepSpeedConfig expects a dict or the path of a JSON file, got {config_file_or_dict!r}"
            )
        self.config: dict[str, Any] = config
        stage = self.get_value("zero_optimization.stage", -1)
        self._stage = int(stage) if stage != "auto" else -1
        devices = (self.get_value(f"zero_optimization.{k}.device") for k in ("offload_optimizer", "offload_param"))
        self._offload = self._stage in (2, 3) and any(d in ("cpu", "nvme") for d in devices)

    def find_config_node(self, ds_key_long: str) -> tuple[dict[str, Any] | None, str]:
        """``(parent dict, last key)`` of a dotted key; the parent is None when a middle part is missing."""
        *parents, key = ds_key_long.split(".")
        node: Any = self.config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, key
        return node, key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """The value at a dotted key (``"zero_optimization.stage"``), or ``default``."""
        node, key = self.find_config_node(ds_key_long)
        return default if node is None else node.get(key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        """Delete the subtree at a dotted key; with ``must_exist`` a missing key raises ValueError naming it."""
        node, key = self.find_config_node(ds_key_long)
        if node is None or key not in node:
            if must_exist:
                raise ValueError(f"HfDeepSpeedConfig: {ds_key_long!r} is not in the config")
            return
        del node[key]

    def is_true(self, ds_key_long: str) -> bool:
        """True if the key is set to a true value (False when missing)."""
        return bool(self.get_value(ds_key_long, False))

    def is_false(self, ds_key_long: str) -> bool:
        """True if the key is present and false (False when missing)."""
        value = self.get_value(ds_key_long)
        return value is not None and not value

    def is_zero2(self) -> bool:
        """``zero_optimization.stage == 2``."""
        return self._stage == 2

    def is_zero3(self) -> bool:
        """``zero_optimization.stage == 3``."""
        return self._stage == 3

    def is_offload(self) -> bool:
        """Optimizer or parameter offload to ``cpu`` / ``nvme`` at stage 2 or 3."""
        return self._offload
