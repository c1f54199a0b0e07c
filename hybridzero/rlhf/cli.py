"""``hybridzero sft | reward | ppo | grpo | plot | demo``: the RLHF steps on the command line.

The training commands run on the process group torchrun set up (``torchrun --nproc_per_node N -m hybridzero ppo
…``); started without torchrun they run as a world of 1, or — with ``--world_size N`` — relaunch themselves under
``python -m torch.distributed.run --standalone`` with ``OMP_NUM_THREADS=1``. Bad settings print one error line
naming the key and value and exit 2 before any process group exists; a data or model error raised while training
prints one line and exits 1.

``demo`` runs the embedded default: SFT -> reward model -> PPO on the shipped task at world 2 (see
:mod:`hybridzero.rlhf.demo`). ``plot RUN_DIR`` writes PNG curves of a run's ``metrics.jsonl``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

from hybridzero.rlhf.cli_args import add_settings_arguments, settings_from_args
from hybridzero.rlhf.settings import (
    GRPOSettings,
    PPOSettings,
    RewardSettings,
    SFTSettings,
)

__all__ = ["add_rlhf_commands"]

_STEPS: dict[str, tuple[type, str]] = {
    "sft": (SFTSettings, "step 1: supervised fine-tuning (loss on the response)"),
    "reward": (RewardSettings, "step 2: reward model (pairwise loss, value head on the last token)"),
    "ppo": (PPOSettings, "step 3: PPO with actor, critic, reference and reward model (DeepSpeed-Chat flags)"),
    "grpo": (GRPOSettings, "step 3 with GRPO: group-relative advantages, no critic"),
}


def _relaunch(world: int, argv: list[str]) -> int:
    """Run ``hybridzero ARGV`` under ``torch.distributed.run`` with ``world`` local ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           "-m", "hybridzero", *argv]
    try:
        return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False).returncode
    except KeyboardInterrupt:
        return 130


def _strip_world(argv: list[str]) -> list[str]:
    """``argv`` without ``--world_size N`` / ``--world-size N`` (the relaunched ranks must not relaunch)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in ("--world_size", "--world-size"):
            skip = True
        elif not item.startswith(("--world_size=", "--world-size=")):
            out.append(item)
    return out


def _run_step(args: argparse.Namespace) -> int:
    """Validate the settings, relaunch if asked, else train on this process group."""
    model, _ = _STEPS[args.command]
    try:
        settings = settings_from_args(model, args)
    except ValueError as exc:
        print(f"{args.command}: error: {exc}", file=sys.stderr)
        return 2
    if args.world_size and "RANK" not in os.environ:
        return _relaunch(args.world_size, _strip_world(sys.argv[1:] if args.argv is None else args.argv))
    from hybridzero.rlhf.reward import train_reward
    from hybridzero.rlhf.sft import train_sft
    from hybridzero.rlhf.step3 import train_step3

    try:
        if args.command == "sft":
            train_sft(settings)
        elif args.command == "reward":
            train_reward(settings)
        else:
            monitor = _demo_monitor() if getattr(settings, "monitor", "none") == "demo" else None
            train_step3(settings, monitor=monitor)
    except (ValueError, FileNotFoundError) as exc:
        print(f"{args.command}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _demo_monitor() -> Any:
    """Per-sample sums of the hidden demo rule (logged only; the policy never sees it)."""
    from hybridzero.rlhf.demo_task import rule_scores

    def monitor(prompts: list[str], answers: list[str]) -> dict[str, float]:
        scores = rule_scores(prompts, answers)
        return {"rule_score": scores["exact"] * len(prompts), "copy_rate": scores["copy"] * len(prompts)}

    return monitor


def _plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hybridzero.rlhf.plot import PlotsUnavailable, plot_run

    try:
        paths = plot_run(Path(args.run_dir), Path(args.out) if args.out else None)
    except (FileNotFoundError, ValueError, PlotsUnavailable) as exc:
        print(f"plot: error: {exc}", file=sys.stderr)
        return 1
    print(f"plot: wrote {len(paths)} PNG files: {', '.join(str(p) for p in paths)}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ and args.world_size > 1:
        argv = ["demo", "--output_dir", args.output_dir, "--world_size", "1"] + (["--quick"] if args.quick else [])
        return _relaunch(args.world_size, argv)
    from hybridzero.rlhf.demo import run_demo

    run_demo(args.output_dir, quick=args.quick)
    return 0


def add_rlhf_commands(subparsers: Any) -> None:
    """Register the RLHF subcommands."""
    for name, (model, text) in _STEPS.items():
        p = subparsers.add_parser(name, help=text, description=f"{text}. Flags are the settings' keys "
                                  "(DeepSpeed-Chat's names); --config FILE gives them as JSON.")
        add_settings_arguments(p, model)
        p.add_argument("--world_size", "--world-size", dest="world_size", type=int, default=0,
                       help="relaunch under torch.distributed.run with N local ranks (outside torchrun)")
        p.set_defaults(func=_run_step, argv=None)
    p = subparsers.add_parser("plot", help="PNG curves of a run directory's metrics.jsonl")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")
    p.set_defaults(func=_plot)
    p = subparsers.add_parser("demo", help="the embedded default: SFT -> reward model -> PPO on the shipped task",
                              description="Train a tiny Llama from scratch on the shipped 'reverse the digits' "
                                          "task through all three steps, then report the hidden rule's score.")
    p.add_argument("--output_dir", "--output-dir", default="runs/demo")
    p.add_argument("--world_size", "--world-size", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a few steps per stage (smoke run)")
    p.set_defaults(func=_demo)
