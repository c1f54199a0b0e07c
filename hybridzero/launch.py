"""``hybridzero launch``: DeepSpeed's launcher flags mapped onto ``torch.distributed.run`` (torchrun).

A DeepSpeed-Chat script changes in one line: ``deepspeed [--num_gpus N] main.py ARGS`` becomes
``hybridzero launch [--num_gpus N] STEP ARGS`` with ``STEP`` one of ``sft`` (step 1), ``reward`` (step 2), ``ppo``
or ``grpo`` (step 3); ``step1`` / ``step2`` / ``step3`` are accepted as names of the same. Launcher flags (only
before ``STEP``; everything after it belongs to the step):

* ``--num_gpus N`` / ``--num_procs N``: local processes (default: the GPUs torch sees, else 1);
* ``--num_nodes M``, ``--node_rank R``, ``--master_addr A``, ``--master_port P``: a multi-node rendezvous (as
  torchrun's ``--nnodes``/``--node_rank``/``--master_addr``/``--master_port``); with none of them the run is
  ``--standalone``;
* ``--bind_cores_to_rank`` (and ``--bind_core_list LIST``, whose cores it counts): as DeepSpeed, each rank gets
  its share of the cores as ``OMP_NUM_THREADS`` (cores // local processes, at least 1); unlike DeepSpeed, ranks are
  not pinned to those cores (torchrun starts them unpinned). Without it ``OMP_NUM_THREADS`` defaults to 1;
* ``--include`` / ``--exclude`` / ``--hostfile`` / ``--launcher``: DeepSpeed's host selection, refused by name (start
  one ``hybridzero launch`` per node instead).

The step's arguments are passed after ``--`` so torchrun's own parser never reads (or abbreviates) them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import torch

__all__ = ["STEP_NAMES", "LaunchSpec", "launch_main", "parse_launch", "torchrun_command"]

STEP_NAMES: dict[str, str] = {
    "sft": "sft",
    "step1": "sft",
    "reward": "reward",
    "step2": "reward",
    "ppo": "ppo",
    "step3": "ppo",
    "grpo": "grpo",
}
_VALUED = {
    "--num_gpus": "procs",
    "--num_procs": "procs",
    "--num_nodes": "nodes",
    "--node_rank": "node_rank",
    "--master_addr": "master_addr",
    "--master_port": "master_port",
    "--bind_core_list": "core_list",
}
_SWITCHES = {"--bind_cores_to_rank": "bind_cores"}  # launcher flags without a value
_REFUSED = ("--include", "--exclude", "--hostfile", "--launcher", "--ssh_port", "--autotuning")
USAGE = (
    "usage: hybridzero launch [--num_gpus N] [--num_nodes M --node_rank R --master_addr A] [--master_port P] "
    "[--bind_cores_to_rank [--bind_core_list LIST]] STEP [STEP ARGS...]   (STEP: "
    + ", ".join(sorted(set(STEP_NAMES)))
    + ")"
)


@dataclass(frozen=True)
class LaunchSpec:
    """What the launcher flags asked for."""

    procs: int
    nodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    bind_cores: bool = False
    core_list: str | None = None

    def threads_per_rank(self, cores: int) -> int:
        """``OMP_NUM_THREADS`` of each local rank under ``--bind_cores_to_rank``: its share of ``cores`` (or of
        ``--bind_core_list``'s cores), at least 1."""
        if self.core_list:
            cores = len(_core_ids(self.core_list))
        return max(cores // self.procs, 1)


def _core_ids(text: str) -> list[int]:
    """DeepSpeed's ``--bind_core_list`` syntax: ``0,2-5,8`` (ValueError naming the flag on anything else)."""
    ids: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            ids.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"--bind_core_list {text!r}: expected core numbers and ranges like 0,2-5,8") from None
    if not ids:
        raise ValueError(f"--bind_core_list {text!r}: names no core")
    return ids


def _int(flag: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected an integer") from None
    if value < (0 if flag == "--node_rank" else 1):
        raise ValueError(f"{flag} {value}: must be {'>= 0' if flag == '--node_rank' else 'positive'}")
    return value


def parse_launch(argv: list[str], default_procs: int = 1) -> tuple[LaunchSpec, str, list[str]]:
    """``(spec, step, step_args)`` from ``hybridzero launch`` arguments; ``ValueError`` naming a bad flag."""
    values: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        flag, _, inline = argv[i].partition("=")
        if flag in _SWITCHES and not inline:
            values[_SWITCHES[flag]], i = "1", i + 1
            continue
        if flag in _REFUSED:
            raise ValueError(
                f"{flag} is not supported by hybridzero launch: it starts the processes of this node "
                "only (run one launch per node with --num_nodes/--node_rank/--master_addr)"
            )
        if flag not in _VALUED:
            raise ValueError(
                f"unknown launcher flag {flag!r}; launcher flags are {', '.join([*_VALUED, *_SWITCHES])} and "
                "come before STEP"
            )
        if inline:
            values[_VALUED[flag]], i = inline, i + 1
        elif i + 1 < len(argv):
            values[_VALUED[flag]], i = argv[i + 1], i + 2
        else:
            raise ValueError(f"{flag} needs a value")
    if i >= len(argv):
        raise ValueError(f"no STEP given; {USAGE}")
    step = argv[i]
    if step.endswith(".py") or step not in STEP_NAMES:
        raise ValueError(
            f"STEP {step!r} is not one of {sorted(set(STEP_NAMES))} (replace DeepSpeed-Chat's main.py "
            "by the step it trains)"
        )
    spec = LaunchSpec(
        procs=_int("--num_gpus", values["procs"]) if "procs" in values else default_procs,
        nodes=_int("--num_nodes", values["nodes"]) if "nodes" in values else 1,
        node_rank=_int("--node_rank", values["node_rank"]) if "node_rank" in values else 0,
        master_addr=values.get("master_addr"),
        master_port=_int("--master_port", values["master_port"]) if "master_port" in values else None,
        bind_cores="bind_cores" in values,
        core_list=values.get("core_list"),
    )
    if spec.core_list is not None:
        _core_ids(spec.core_list)  # a malformed list fails here, naming the flag
    if spec.node_rank >= spec.nodes:
        raise ValueError(f"--node_rank {spec.node_rank} must be below --num_nodes {spec.nodes}")
    return spec, STEP_NAMES[step], argv[i + 1 :]


def torchrun_command(spec: LaunchSpec, step: str, step_args: list[str]) -> list[str]:
    """The ``python -m torch.distributed.run ... -m hybridzero -- STEP ARGS`` command line of ``spec``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(spec.procs)]
    if spec.nodes == 1 and spec.master_addr is None and spec.master_port is None:
        cmd.append("--standalone")
    else:
        cmd += [
            "--nnodes",
            str(spec.nodes),
            "--node_rank",
            str(spec.node_rank),
            "--master_addr",
            spec.master_addr or "127.0.0.1",
            "--master_port",
            str(spec.master_port or 29500),
        ]
    return [*cmd, "-m", "hybridzero", "--", step, *step_args]


def launch_main(argv: list[str]) -> int:
    """Run ``hybridzero launch ARGV``; returns the exit status (2 for a bad launcher flag)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (__doc__ or "").split("\n\n", 1)[1])
        return 0 if argv else 2
    try:
        spec, step, rest = parse_launch(argv, default_procs=max(torch.cuda.device_count(), 1))
    except ValueError as exc:
        print(f"launch: error: {exc}", file=sys.stderr)
        return 2
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    if spec.bind_cores:  # DeepSpeed's --bind_cores_to_rank sets each rank's threads to its core share
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = str(spec.threads_per_rank(cores))
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    try:
        return subprocess.run(torchrun_command(spec, step, rest), env=env, check=False).returncode
    except KeyboardInterrupt:
        return 130
