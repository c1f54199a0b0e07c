"""``hybridzero plan``: the command line of :mod:`hybridzero.plan`.

``hybridzero plan --model (HF dir | config.json | known name) --config ds_config.json --nodes N --gpus_per_node G
[--device PROFILE] [--link intra=...,inter=...] [--rlhf actor=...,critic=...] [--search] [--json PATH]``

Bad input (unknown model, profile or link, a config the engine would refuse) prints one error line naming it and
exits 1; the table goes to stdout, the JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hybridzero.argtypes import int_range, path_text
from hybridzero.config import ConfigError
from hybridzero.config.load import read_json
from hybridzero.plan.model import LoRAPlan, known_shapes, load_hf_config, meta_model
from hybridzero.plan.pipeline import RLHFShape, plan_rlhf
from hybridzero.plan.planner import Cluster, Workload, plan_model
from hybridzero.plan.profiles import device_profile, links_for, profile_names
from hybridzero.plan.report import model_table, rlhf_table, search_table
from hybridzero.plan.search import search

__all__ = ["add_plan_command", "parse_roles", "run_plan"]

ROLES = ("actor", "critic", "ref", "reward")


def add_plan_command(subparsers: Any) -> None:
    """Register ``plan``."""
    devices, links = profile_names()
    positive = int_range(1)
    p = subparsers.add_parser(
        "plan",
        allow_abbrev=False,
        help="what a run will cost on a cluster: memory per rank, bytes per collective and link, step time",
        description="Plan a run from the engine's own layout and gather rules on a meta-device model: model-state "
        "bytes per rank, collectives per step by link class, a roofline step time; --rlhf for DeepSpeed-Chat's four "
        "models, --search to rank the configurations that fit. Known models: " + ", ".join(known_shapes()),
    )
    p.add_argument("--model", required=True, type=path_text, help="HF directory, config.json, or a known name")
    p.add_argument(
        "--config", required=True, type=path_text, help="DeepSpeed JSON config (batch keys are resolved per world size)"
    )
    p.add_argument("--nodes", type=positive, default=1, help="number of nodes (default 1)")
    p.add_argument("--gpus_per_node", type=positive, default=8, help="ranks per node (default 8)")
    p.add_argument("--device", default="a100-80gb", help=f"device profile: {', '.join(devices)} (default a100-80gb)")
    p.add_argument("--link", default=None, help=f"intra=NAME,inter=NAME with NAME in {', '.join(links)} or Gb/s")
    p.add_argument("--seq_len", type=positive, default=2048, help="tokens per training sequence (default 2048)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing in the step-time model")
    p.add_argument("--lora", default=None, metavar="PART:DIM", help="LoRA on nn.Linear names containing PART")
    p.add_argument(
        "--rlhf",
        default=None,
        help="actor=M,critic=M[,ref=M,reward=M]: plan DS-Chat step 3 (--model is the default actor)",
    )
    p.add_argument("--prompt_len", type=positive, default=256, help="RLHF prompt tokens (default 256)")
    p.add_argument("--answer_len", type=positive, default=256, help="RLHF generated tokens (default 256)")
    p.add_argument("--search", action="store_true", help="rank the configurations that fit by step time per token")
    p.add_argument("--top", type=positive, default=10, help="how many --search results (default 10)")
    p.add_argument("--json", default=None, type=path_text, metavar="PATH", help="also write the plan as JSON")
    p.set_defaults(func=run_plan)


def parse_roles(spec: str, default: str) -> dict[str, str]:
    """``actor=M,critic=M,...`` as a role -> model map (ref defaults to the actor, reward to the critic)."""
    roles: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ROLES or not value.strip():
            raise ValueError(f"--rlhf part {part!r} is invalid: use role=MODEL with role in {', '.join(ROLES)}")
        roles[key.strip()] = value.strip()
    roles.setdefault("actor", default)
    roles.setdefault("critic", roles["actor"])
    roles.setdefault("ref", roles["actor"])
    roles.setdefault("reward", roles["critic"])
    return roles


def _lora(spec: str | None) -> LoRAPlan | None:
    if spec is None:
        return None
    part, sep, dim = spec.rpartition(":")
    if not sep or not part or not dim.isdigit():
        raise ValueError(f"--lora {spec!r} is invalid: use PART:DIM, e.g. self_attn:128")
    return LoRAPlan(part, int(dim))


def _build(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    if args.search and args.rlhf:
        raise ValueError("--search ranks the configurations of one model; it does not combine with --rlhf")
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ValueError(f"--nodes {args.nodes} and --gpus_per_node {args.gpus_per_node} must be >= 1")
    cluster = Cluster(args.nodes, args.gpus_per_node, device_profile(args.device), links_for(args.device, args.link))
    raw = dict(read_json(args.config))
    lora = _lora(args.lora)
    mem = cluster.device.memory_bytes
    if args.rlhf:
        roles = parse_roles(args.rlhf, args.model)
        actor, critic, ref, reward = (load_hf_config(roles[r]) for r in ROLES)
        shape = RLHFShape(
            actor,
            critic,
            ref,
            reward,
            prompt=args.prompt_len,
            answer=args.answer_len,
            checkpointing=args.checkpointing,
        )
        result = plan_rlhf(shape, raw, cluster, lora)
        return result, rlhf_table(result, mem)
    hf = load_hf_config(args.model)
    model = meta_model(hf, lora=lora)
    if args.search:
        ranked = search(model, hf, raw, cluster, args.seq_len, args.top)
        return {"search": ranked}, search_table(ranked)
    plan = plan_model(model, hf, raw, cluster, Workload(args.seq_len, args.checkpointing))
    return plan, model_table(plan, args.model, mem)


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan's table (and write its JSON); one error line and status 1 on bad input."""
    try:
        result, table = _build(args)
    except (ValueError, ConfigError, OSError) as exc:  # ConfigError names the key, ValueError the argument
        print(f"plan: error: {exc}", file=sys.stderr)
        return 1
    header = f"# hybridzero plan: {args.nodes} node(s) x {args.gpus_per_node} {args.device}"
    print(header + "\n\n" + table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0
