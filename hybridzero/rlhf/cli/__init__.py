"""``hybridzero sft | reward | ppo | grpo | plot | demo``: the RLHF steps on the command line.

The training commands run on the process group torchrun set up (``torchrun --nproc_per_node N -m hybridzero ppo
…``); started without torchrun they run as a world of 1, or — with ``--world_size N`` — relaunch themselves under
``python -m torch.distributed.run --standalone`` with ``OMP_NUM_THREADS=1``. Bad settings print one error line
naming the key and value and exit 2 before any process group exists; a data or model error raised while training
prints one line and exits 1.

``demo`` runs the embedded default: SFT -> reward model -> PPO on the shipped task at world 2 (see
:mod:`hybridzero.rlhf.demo`). ``plot RUN_DIR`` writes PNG curves of a run's ``metrics.jsonl``.

Flags: every settings field ``name`` is a flag ``--name``, generated from the settings models by
:mod:`hybridzero.rlhf.cli.flags` (its public names are re-exported here). A model or data error prints one line
(``--debug``: the traceback) and exits 1; a model path or Hub id is checked before anything starts
(:func:`~hybridzero.rlhf.models.check_loadable`).
``hybridzero launch`` (:mod:`hybridzero.launch`) stands in for ``deepspeed main.py``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from hybridzero.argtypes import MAX_LOCAL_RANKS, int_range, path_text
from hybridzero.optim.loss_scaler import LossScaleUnderflowError
from hybridzero.rlhf.cli.flags import UNSUPPORTED, add_settings_arguments, settings_from_args
from hybridzero.rlhf.demo.arith_run import run_arith_demo
from hybridzero.rlhf.demo.run import demo_monitor, run_demo
from hybridzero.rlhf.models import check_loadable
from hybridzero.rlhf.rewards.functions import check_reward_specs
from hybridzero.rlhf.runlog.plot import PlotsUnavailable, plot_run
from hybridzero.rlhf.settings import (
    GRPOSettings,
    PPOSettings,
    RewardSettings,
    SFTSettings,
    SupervisedSettings,
)
from hybridzero.rlhf.steps.reward_model import train_reward
from hybridzero.rlhf.steps.rl.trainer import train_step3
from hybridzero.rlhf.steps.sft import train_sft

__all__ = ["UNSUPPORTED", "add_rlhf_commands", "add_settings_arguments", "settings_from_args"]

_STEPS: dict[str, tuple[type, str]] = {
    "sft": (SFTSettings, "step 1: supervised fine-tuning (loss on the response)"),
    "reward": (RewardSettings, "step 2: reward model (pairwise loss, value head on the last token)"),
    "ppo": (PPOSettings, "step 3: PPO with actor, critic, reference and reward model (DeepSpeed-Chat flags)"),
    "grpo": (GRPOSettings, "step 3 with GRPO: group-relative advantages, no critic"),
}


def _relaunch(world: int, argv: list[str]) -> int:
    """Run ``hybridzero ARGV`` under ``torch.distributed.run`` with ``world`` local ranks."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(world),
        "-m",
        "hybridzero",
        "--",
        *argv,
    ]  # after "--": torchrun's parser never reads (or abbreviates) our flags
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
    try:
        _check_models(settings)
        if isinstance(settings, SFTSettings):
            train_sft(settings)
        elif isinstance(settings, RewardSettings):
            train_reward(settings)
        else:
            assert isinstance(settings, PPOSettings)  # GRPOSettings included
            monitor = demo_monitor() if getattr(settings, "monitor", "none") == "demo" else None
            train_step3(settings, monitor=monitor)
    except (ValueError, OSError, ImportError, LossScaleUnderflowError) as exc:  # ModelLoadError is a ValueError
        if getattr(args, "debug", False):
            raise
        print(f"{args.command}: error: {_one_line(exc)}{_hint(exc, args.command)}", file=sys.stderr)
        return 1
    return 0


def _hint(exc: BaseException, command: str) -> str:
    """What the command's own flags can do about ``exc`` (the steps write their fp16 block themselves: its
    ``initial_scale_power`` 16 and ``min_loss_scale`` 1 are not flags)."""
    if not isinstance(exc, LossScaleUnderflowError):
        return ""
    rates = {"sft": "--learning_rate", "reward": "--learning_rate", "grpo": "--actor_learning_rate"}
    rate = rates.get(command, "--actor_learning_rate / --critic_learning_rate")
    return f" (here: pass --dtype bf16 or fp32, or a smaller {rate})"


def _one_line(exc: BaseException) -> str:
    """The first line of an error (transformers' load errors run to many lines; --debug shows them whole)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _check_models(settings: BaseModel) -> None:
    """Fail in one line, before any engine exists, on a model path or Hub id that cannot be loaded."""
    if isinstance(settings, PPOSettings):
        check_loadable(settings.actor_model_name_or_path, "--actor_model_name_or_path")
        if not isinstance(settings, GRPOSettings) or settings.uses_reward_model():
            check_loadable(settings.critic_model_name_or_path, "--critic_model_name_or_path")
        if isinstance(settings, GRPOSettings):  # a bad spec fails before any process group exists
            check_reward_specs(settings.reward_funcs, settings.reward_timeout)
    elif isinstance(settings, SupervisedSettings):
        check_loadable(settings.model_name_or_path, "--model_name_or_path")


def _plot(args: argparse.Namespace) -> int:
    try:
        paths = plot_run(Path(args.run_dir), Path(args.out) if args.out else None)
    except (FileNotFoundError, ValueError, PlotsUnavailable) as exc:
        print(f"plot: error: {exc}", file=sys.stderr)
        return 1
    print(f"plot: wrote {len(paths)} PNG files: {', '.join(str(p) for p in paths)}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    out = args.output_dir or ("runs/demo" if args.task == "reverse" else "runs/demo_arith")
    if "RANK" not in os.environ and args.world_size > 1:
        argv = ["demo", "--task", args.task, "--output_dir", out, "--world_size", "1"]
        argv += ["--rollout_engine", args.rollout_engine]
        return _relaunch(args.world_size, argv + (["--quick"] if args.quick else []))
    if args.task == "arithmetic":
        run_arith_demo(out, quick=args.quick, rollout_engine=args.rollout_engine)
    else:
        run_demo(out, quick=args.quick, rollout_engine=args.rollout_engine)
    return 0


def add_rlhf_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register the RLHF subcommands."""
    for name, (model, text) in _STEPS.items():
        p = subparsers.add_parser(
            name,
            allow_abbrev=False,
            help=text,
            description=f"{text}. Flags are the settings' keys "
            "(DeepSpeed-Chat's names); --config FILE gives them as JSON.",
        )
        add_settings_arguments(p, model)
        p.add_argument(
            "--world_size",
            "--world-size",
            dest="world_size",
            type=int_range(0, MAX_LOCAL_RANKS),
            default=0,
            help="relaunch under torch.distributed.run with N local ranks (outside torchrun; 0: no relaunch)",
        )
        p.set_defaults(func=_run_step, argv=None)
    p = subparsers.add_parser("plot", allow_abbrev=False, help="PNG curves of a run directory's metrics.jsonl")
    p.add_argument("run_dir", metavar="RUN_DIR", type=path_text)
    p.add_argument("--out", default=None, type=path_text, help="output folder (default RUN_DIR/plots)")
    p.set_defaults(func=_plot)
    p = subparsers.add_parser(
        "demo",
        allow_abbrev=False,
        help="the embedded default: SFT -> reward model -> PPO on the shipped task",
        description="Train a tiny Llama from scratch on the shipped 'reverse the digits' "
        "task through all three steps, then report the hidden rule's score.",
    )
    p.add_argument(
        "--task",
        choices=("reverse", "arithmetic"),
        default="reverse",
        help="reverse: SFT -> reward model -> PPO on 'reverse the digits' (default); arithmetic: SFT on imperfect "
        "'add a digit' demonstrations -> GRPO with reward functions only (exact checker + format)",
    )
    p.add_argument(
        "--output_dir", "--output-dir", default=None, type=path_text, help="default runs/demo or runs/demo_arith"
    )
    p.add_argument("--world_size", "--world-size", type=int_range(1, MAX_LOCAL_RANKS), default=2)
    p.add_argument("--quick", action="store_true", help="a few steps per stage (smoke run)")
    p.add_argument(
        "--rollout_engine",
        "--rollout-engine",
        choices=("hf", "vllm"),
        default="hf",
        help="the RL step's rollouts: hf = the hybrid engine (default); vllm = a colocated vLLM engine per rank "
        "(needs the vllm extra; evaluation always generates with hf)",
    )
    p.set_defaults(func=_demo)
