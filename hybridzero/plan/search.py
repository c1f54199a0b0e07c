"""``--search``: the configurations of a model on a cluster that fit, ranked by estimated time per token.

Candidates vary what a user tunes (stage, hpZ size, qwZ/qgZ, optimizer offload, micro-batch, activation
checkpointing) over the user's DeepSpeed config, keeping everything else (optimizer, accumulation, buckets). A
candidate fits when its device bytes (model states on the device, peak gathered buffers, activations) stay within
:data:`~hybridzero.plan.planner.HEADROOM` of the device's memory. Ranking is by step time per token (micro-batches
differ in work), fastest first; ties (compute-bound candidates) go to the one moving fewer bytes across nodes.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import transformers
from torch import nn

from hybridzero.plan.planner import HEADROOM, Cluster, Workload, plan_model

__all__ = ["MICRO_BATCHES", "candidates", "search"]

MICRO_BATCHES = (1, 2, 4, 8, 16)


def candidates(raw: dict[str, Any], cluster: Cluster) -> Iterator[tuple[dict[str, Any], bool]]:
    """Every (DeepSpeed config, checkpointing) variant of ``raw`` the search considers, in a stable order."""
    hpz_sizes = [1] + ([cluster.gpus_per_node] if cluster.nodes > 1 and cluster.gpus_per_node > 1 else [])
    for stage in (0, 1, 2, 3):
        z3 = stage == 3
        for hpz, qwz, qgz in itertools.product(
            hpz_sizes if z3 else [1], (False, True) if z3 else [False], (False, True) if z3 else [False]
        ):
            for offload in ("none", "cpu") if stage > 0 else ("none",):
                for micro, ckpt in itertools.product(MICRO_BATCHES, (False, True)):
                    cfg = copy.deepcopy(raw)
                    cfg.pop("train_batch_size", None)
                    cfg["train_micro_batch_size_per_gpu"] = micro
                    cfg.setdefault("gradient_accumulation_steps", 1)
                    zero = dict(cfg.get("zero_optimization") or {})
                    zero.update(
                        stage=stage,
                        zero_hpz_partition_size=hpz,
                        zero_quantized_weights=qwz,
                        zero_quantized_gradients=qgz,
                    )
                    zero.pop("offload_optimizer", None)
                    zero.pop("offload_param", None)
                    if offload != "none":
                        zero["offload_optimizer"] = {"device": offload}
                    cfg["zero_optimization"] = zero
                    yield cfg, ckpt


def search(
    model: nn.Module,
    hf: transformers.PretrainedConfig,
    raw: dict[str, Any],
    cluster: Cluster,
    seq_len: int,
    top: int = 10,
) -> list[dict[str, Any]]:
    """The ``top`` fitting candidates, fastest per token first (each a plan without its collective rows)."""
    budget = HEADROOM * cluster.device.memory_bytes
    fitting: list[dict[str, Any]] = []
    for cfg, ckpt in candidates(raw, cluster):
        with warnings.catch_warnings():  # the user's config already warned once, by name, when it was loaded
            warnings.simplefilter("ignore")
            plan = plan_model(model, hf, cfg, cluster, Workload(seq_len, checkpointing=ckpt))
        if plan["memory"]["device_total"] > budget:
            continue
        tokens = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * seq_len
        plan.pop("collectives")
        plan["tokens_per_s_per_rank"] = tokens / plan["step_time"]["total_s"]
        fitting.append(plan)
    fitting.sort(key=lambda p: (-p["tokens_per_s_per_rank"], p["by_link"]["inter"]["wire_bytes"]))
    return fitting[:top]
