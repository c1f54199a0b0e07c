"""``hybridzero sft | reward | ppo | grpo | plot | demo``: the RLHF steps on the command line.

The training commands run on the process group torchrun set up (``torchrun --nproc_per_node N -m hybridzero ppo
…``); started without torchrun they run as a world of 1, or — with ``--world_size N`` — relaunch themselves under
``python -m torch.distributed.run --standalone`` with ``OMP_NUM_THREADS=1``. Bad settings print one error line
naming the key and value and exit 2 before any process group exists; a data or model error raised while training
prints one line and exits 1.

``demo`` runs the embedded default: SFT -> reward model -> PPO on the shipped task at world 2 (see
:mod:`hybridzero.rlhf.demo`). ``plot RUN_DIR`` writes PNG curves of a run's ``metrics.jsonl``.

Flags (:func:`add_settings_arguments`): every settings field ``name`` is a flag ``--name`` (``--name-with-dashes``
too). Booleans take an optional value (``--enable_ema`` or ``--enable_ema false``). ``--config FILE`` reads a JSON
object of settings first; flags given on the command line override it. DeepSpeed-Chat flags that hybridzero does
not implement are accepted only at their DeepSpeed-Chat default (a no-op); any other value is an error naming the
flag and why. Launcher and config flags (``--local_rank``, ``--deepspeed``, ``--deepspeed_config``, ``--deepscale``,
``--deepscale_config``) are accepted and ignored. A model or data error prints one line (``--debug``: the traceback)
and exits 1; a model path or Hub id is checked before anything starts (:func:`~hybridzero.rlhf.models.check_loadable`).
``hybridzero launch`` (:mod:`hybridzero.launch`) stands in for ``deepspeed main.py``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from hybridzero.argtypes import MAX_LOCAL_RANKS, int_range, path_text
from hybridzero.optim.loss_scaler import LossScaleUnderflowError
from hybridzero.rlhf.demo.arith_run import run_arith_demo
from hybridzero.rlhf.demo.run import demo_monitor, run_demo
from hybridzero.rlhf.models import check_loadable
from hybridzero.rlhf.rewards.functions import check_reward_specs
from hybridzero.rlhf.runlog.plot import PlotsUnavailable, plot_run
from hybridzero.rlhf.settings import (
    GRPO_ALIASES,
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

# flag -> (DeepSpeed-Chat default that means "off", why hybridzero refuses any other value)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "offload_reference_model": (False, "step 3 has a reference model; steps 1-2 have none"),
    "dropout": (None, "dropout is forced to 0 so log-probabilities are deterministic"),
    "actor_dropout": (None, "dropout is forced to 0 so log-probabilities are deterministic"),
    "critic_dropout": (None, "dropout is forced to 0 so log-probabilities are deterministic"),
}
# LoRA flags of the other steps (step 3's on sft/reward and vice versa): DS-Chat's scripts only pass their own
# step's, so these are accepted with any value and have no effect there (the LoRA flags of a step are settings
# fields: hybridzero.rlhf.settings.SupervisedLoRA / Step3LoRA, read by hybridzero.rlhf.lora)
_LORA_COMPANIONS = (
    "lora_dim",
    "lora_module_name",
    "lora_learning_rate",
    "actor_lora_dim",
    "actor_lora_module_name",
    "critic_lora_dim",
    "critic_lora_module_name",
    "actor_lora_learning_rate",
    "critic_lora_learning_rate",
    "enable_mixed_precision_lora",
)
# accepted and without effect here, with the reason shown by --help
_IGNORED = {
    "local_rank": "set by the launcher; torchrun's LOCAL_RANK is used",
    "deepspeed": "DeepSpeed's launcher switch; hybridzero builds its own config",
    "deepspeed_config": "DeepSpeed-Chat builds its config from the flags too; hybridzero does the same",
    "deepscale": "DeepSpeed's old name of --deepspeed",
    "deepscale_config": "DeepSpeed's old name of --deepspeed_config",
    "unpin_actor_parameters": "the hybrid engine keeps no gathered parameters between generations (nothing to unpin)",
    "release_inference_cache": "the hybrid engine keeps no inference cache between generations (nothing to release)",
    "disable_dropout": "dropout is always 0 (log-probabilities must be deterministic)",
    "disable_actor_dropout": "dropout is always 0 (log-probabilities must be deterministic)",
    "disable_critic_dropout": "dropout is always 0 (log-probabilities must be deterministic)",
    "data_output_path": "tokenized data is not cached on disk",
    "preprocessing_num_workers": "tokenization runs in-process",
    "num_padding_at_beginning": "scores are read at the last token by the attention mask",
    "compute_fp32_loss": "log-probabilities and losses are always computed in fp32",
    "align_overflow": "an fp16 overflow in actor or critic always skips both updates",
    "tensorboard_path": "TensorBoard files go to OUTPUT_DIR/tensorboard",
    "eval_iters": "evaluation covers the whole held-out split",
    "print_answers_interval": "answers are printed with the report every --print_every iterations",
    "add_eot_token": "step 3 uses the tokenizer steps 1-2 saved (it ends answers with the eot token if they added it)",
    "eot_token": "step 3 uses the tokenizer steps 1-2 saved (it ends answers with the eot token if they added it)",
}
_ALIASES: dict[str, str] = {}


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _loose(text: str) -> Any:
    """A JSON value if it parses as one, else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _is_path(name: str) -> bool:
    """Whether the setting ``name`` names files or directories (``data_path``, ``output_dir``, ``data_root``,
    ``*_model_name_or_path``): its flag refuses an empty value or a NUL byte at parse time."""
    return name.endswith(("_path", "_dir", "_root"))


def _flag_kwargs(annotation: Any, path: bool = False) -> dict[str, Any]:
    """argparse keyword arguments for a field's annotation (``path``: text through :func:`path_text`).

    Ranges and finiteness are left to the settings model, so a flag and the same key in ``--config`` get one
    message; argparse only converts the text (a non-number is a one-line parser error naming the flag)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    text = path_text if path else str
    if annotation is bool:
        return {"nargs": "?", "const": True, "type": _parse_bool}
    if origin is list:
        return {"nargs": "*", "type": text}
    if origin is typing.Literal:
        return {"type": type(args[0]), "choices": list(args)}
    if args and origin is not None:  # Optional[X]
        return _flag_kwargs(args[0], path)
    return {"type": annotation if annotation in (int, float) else text}


def add_settings_arguments(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """One flag per settings field, plus ``--config`` and DeepSpeed-Chat's accepted/refused flags."""
    parser.add_argument(
        "--config", default=None, type=path_text, help="JSON file of settings; command-line flags override it"
    )
    parser.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of a data or model error"
    )
    for name, field in model.model_fields.items():
        flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        text = field.description or f"default: {field.get_default(call_default_factory=True)!r}"
        kwargs = _flag_kwargs(field.annotation, _is_path(name))
        parser.add_argument(*flags, dest=name, default=argparse.SUPPRESS, help=text, **kwargs)
    for name, why in _IGNORED.items():
        if name in model.model_fields:
            continue  # a setting of this command (steps 1-2's --add_eot_token)
        if name == "disable_dropout" and "dropout" in model.model_fields:  # steps 1-2: DS-Chat's older --dropout 0
            parser.add_argument(
                "--disable_dropout",
                dest="dropout",
                action="store_const",
                const=0.0,
                default=argparse.SUPPRESS,
                help="the same as --dropout 0",
            )
            continue
        parser.add_argument(
            f"--{name}",
            dest=f"ignored__{name}",
            nargs="?",
            const=True,
            default=argparse.SUPPRESS,
            help=f"accepted, no effect: {why}",
        )
    for name in list(UNSUPPORTED) + list(_LORA_COMPANIONS):
        if name not in model.model_fields:
            parser.add_argument(
                f"--{name}",
                dest=f"unsupported__{name}",
                nargs="?",
                const=True,
                type=_loose,
                default=argparse.SUPPRESS,
                help="DeepSpeed-Chat flag; only its default is accepted",
            )
    aliases = {**_ALIASES, **(GRPO_ALIASES if issubclass(model, GRPOSettings) else {})}
    for alias, target in aliases.items():
        kwargs = _flag_kwargs(model.model_fields[target].annotation, _is_path(target))
        parser.add_argument(f"--{alias}", dest=target, default=argparse.SUPPRESS, help=f"alias of --{target}", **kwargs)


def _check_unsupported(given: dict[str, Any]) -> None:
    for key, value in given.items():
        if not key.startswith("unsupported__"):
            continue
        name = key.removeprefix("unsupported__")
        if name in _LORA_COMPANIONS:
            continue
        default, why = UNSUPPORTED[name]
        if value != default and not (default is None and value in (0, 0.0)):
            raise ValueError(
                f"--{name} {value!r} is not supported by hybridzero: {why} "
                f"(only its DeepSpeed-Chat default {default!r} is accepted)"
            )


def _format_validation(exc: ValidationError, model: type[BaseModel]) -> str:
    """One clause per error: the key, the value and what is wrong (unknown keys get the nearest valid one)."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            near = difflib.get_close_matches(where, list(model.model_fields), n=1)
            hint = f"; did you mean --{near[0]}?" if near else ""
            parts.append(f"unknown setting {where!r}{hint}")
        elif where:
            parts.append(f"--{where} {err.get('input')!r}: {err['msg']}")
        else:
            parts.append(err["msg"].removeprefix("Value error, "))
    return "; ".join(parts)


def settings_from_args(model: type[BaseModel], args: argparse.Namespace) -> BaseModel:
    """Settings from ``--config`` then the given flags; ``ValueError`` naming the bad keys/values."""
    given = {
        k: v for k, v in vars(args).items() if k not in ("func", "command", "config", "world_size", "argv", "debug")
    }
    _check_unsupported(given)
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        path = Path(args.config)
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"--config {path}: cannot read a JSON object ({exc})") from None
        if not isinstance(values, dict):
            raise ValueError(f"--config {path}: expected a JSON object of settings, got {type(values).__name__}")
    values.update({k: v for k, v in given.items() if not k.startswith(("ignored__", "unsupported__"))})
    try:
        return model(**values)
    except ValidationError as exc:
        raise ValueError(_format_validation(exc, model)) from None


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
