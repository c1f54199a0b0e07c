"""The ``hybridzero`` command line (``python -m hybridzero …`` or the ``hybridzero`` console script).

Subcommands are registered by small ``_add_*`` functions listed in :func:`build_parser`, each setting a handler
``func(args) -> int``; the RLHF commands (sft, reward, ppo, grpo, plot, demo) come from :mod:`hybridzero.rlhf.cli`.

``launch [--num_gpus N] STEP ARGS`` starts a step under torchrun with DeepSpeed's launcher flags
(:mod:`hybridzero.launch`).

``plan --model M --config ds_config.json --nodes N --gpus_per_node G ...`` predicts memory per rank, collective bytes
per link and step time for a cluster (:mod:`hybridzero.plan.cli`).

``export CKPT_DIR OUT_DIR`` writes a Hugging Face directory (``config.json`` + safetensors) from an engine
checkpoint, streaming one shard file at a time (:func:`hybridzero.checkpoint.export.export_hf`); LoRA adapters are
merged into the weights (``--lora base``: left out) and ``--adapters DIR`` also writes them as a peft directory
(:mod:`hybridzero.checkpoint.lora_export`); errors (unknown tag, non-empty destination, no HF config, no adapters)
print one line to stderr and exit 1.

``convert-checkpoint OLD_DIR NEW_DIR [--tag TAG] [--from format1|deepspeed]`` converts a checkpoint of the old
pickle-based format 1 (:func:`hybridzero.checkpoint.convert_v1`) or a DeepSpeed ZeRO save directory
(:func:`hybridzero.checkpoint.from_deepspeed.convert_deepspeed`) into format 2 without running code stored in it; a
refused file prints one line naming it and exits 1.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hybridzero.argtypes import CLIParser, path_text
from hybridzero.checkpoint.convert import convert_v1
from hybridzero.checkpoint.export import export_hf
from hybridzero.checkpoint.from_deepspeed import convert_deepspeed
from hybridzero.checkpoint.lora_export import export_adapters
from hybridzero.launch import launch_main
from hybridzero.plan.cli import add_plan_command
from hybridzero.rlhf.cli import add_rlhf_commands

__all__ = ["build_parser", "main", "parse_size"]


def _add_export(subparsers: Any) -> None:
    """Register ``export``."""
    p = subparsers.add_parser(
        "export",
        allow_abbrev=False,
        help="write a Hugging Face directory (config.json + safetensors) from an engine checkpoint",
        description="Export checkpoint TAG (default: the one 'latest' names) of CKPT_DIR to OUT_DIR, which "
        "AutoModelForCausalLM.from_pretrained loads. Streams one shard file at a time.",
    )
    p.add_argument(
        "ckpt_dir", metavar="CKPT_DIR", type=path_text, help="checkpoint directory (holds 'latest' and tag folders)"
    )
    p.add_argument("out_dir", metavar="OUT_DIR", type=path_text, help="destination; must not exist or be empty")
    p.add_argument("--tag", default=None, type=path_text, help="checkpoint tag (default: the one 'latest' names)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="weight dtype (default fp32)")
    p.add_argument(
        "--max-shard-size",
        type=parse_size,
        default="5GiB",
        help="largest safetensors file, e.g. 20KB, 500MB, 5GB (powers of 10) or 5GiB (of 2); default 5GiB",
    )
    p.add_argument(
        "--lora",
        choices=("merge", "base"),
        default="merge",
        help="LoRA checkpoints: fold the adapters into the weights (merge, default) or write the base "
        "weights alone (base, for --adapters)",
    )
    p.add_argument(
        "--adapters",
        default=None,
        type=path_text,
        metavar="DIR",
        help="also write the LoRA adapters as a peft directory (PeftModel.from_pretrained loads it)",
    )
    p.set_defaults(func=_export)


def _add_convert(subparsers: Any) -> None:
    """Register ``convert-checkpoint``."""
    p = subparsers.add_parser(
        "convert-checkpoint",
        allow_abbrev=False,
        help="convert a checkpoint of the old pickle-based format 1 (rank_*.pt, extra.pt) to the current format",
        description="Convert format-1 tag TAG (default: the one OLD_DIR/latest names) into a format-2 checkpoint "
        "of the same tag under NEW_DIR, reading the old files with torch.load(weights_only=True) only: a file "
        "that needs more than tensors and plain containers is refused. OLD_DIR is never written; NEW_DIR must be "
        "new, empty or hold only format-2 checkpoints.",
    )
    p.add_argument(
        "old_dir", metavar="OLD_DIR", type=path_text, help="format-1 checkpoint directory (holds 'latest' and tags)"
    )
    p.add_argument("new_dir", metavar="NEW_DIR", type=path_text, help="destination checkpoint directory")
    p.add_argument("--tag", default=None, type=path_text, help="tag to convert (default: the one OLD_DIR/latest names)")
    p.add_argument(
        "--from",
        dest="source",
        choices=("format1", "deepspeed"),
        default="format1",
        help="what OLD_DIR holds: hybridzero's format 1 (default) or a DeepSpeed 0.19.x ZeRO-1/2/3 save directory "
        "(fp32 masters, Adam state, scheduler, loss scale and counters are carried; resumes at any world size)",
    )
    p.set_defaults(func=_convert)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per subcommand: every one a :class:`~hybridzero.argtypes.CLIParser`
    (no abbreviated options, one-line errors with exit status 2)."""
    parser = CLIParser(prog="hybridzero", description="hybridzero: ZeRO-3 sharded training tools.", allow_abbrev=False)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CLIParser)
    for add in (_add_export, _add_convert, add_plan_command, add_rlhf_commands):
        add(subparsers)
    subparsers.add_parser(
        "launch",
        help="DeepSpeed's launcher for a step: hybridzero launch [--num_gpus N] STEP "
        "ARGS (replaces `deepspeed [--num_gpus N] main.py ARGS`)",
        add_help=False,
        allow_abbrev=False,
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand and return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # a relaunch passes our arguments after "--" so torchrun's parser never reads them
        argv = argv[1:]
    if argv[:1] == ["launch"]:  # parsed by hand: everything after STEP belongs to the step, never to argparse
        return launch_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args))


# --- export -----------------------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """Bytes of a size such as ``20KB``, ``5GB`` (10³ steps, like transformers), ``5GiB`` (2¹⁰ steps) or ``1024``."""
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    body = text.strip().upper()
    number = body.rstrip("KMGTIB")
    unit = body[len(number) :]
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use e.g. 20KB, 500MB, 5GB or 5GiB") from None
    if not 1 <= value < float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"size {text!r} must be a finite number of at least 1 byte")
    return int(value)


def _export(args: argparse.Namespace) -> int:
    """Run :func:`hybridzero.checkpoint.export.export_hf`; one error line and status 1 on bad input."""
    try:
        if args.adapters is not None:  # first: a checkpoint without adapters fails before anything is written
            export_adapters(args.ckpt_dir, args.adapters, args.tag, base_model_name_or_path=str(args.out_dir))
        out = export_hf(
            args.ckpt_dir, args.out_dir, args.tag, dtype=args.dtype, max_shard_bytes=args.max_shard_size, lora=args.lora
        )
    except (FileNotFoundError, FileExistsError, ValueError, OSError) as exc:  # CheckpointError is a ValueError
        print(f"export: error: {exc}", file=sys.stderr)
        return 1
    files = sorted(p.name for p in out.iterdir())
    print(f"export: wrote {len(files)} files to {out}: {', '.join(files)}")
    return 0


# --- convert-checkpoint -------------------------------------------------------------------------------------------
def _convert(args: argparse.Namespace) -> int:
    """Run :func:`hybridzero.checkpoint.convert_v1`; one error line and status 1 on a refused checkpoint."""
    try:
        convert = convert_deepspeed if args.source == "deepspeed" else convert_v1
        out = convert(args.old_dir, args.new_dir, args.tag)
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError
        print(f"convert-checkpoint: error: {exc}", file=sys.stderr)
        return 1
    print(f"convert-checkpoint: wrote format-2 checkpoint {out}")
    return 0
