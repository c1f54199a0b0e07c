"""The RLHF commands' flags, generated from the settings models (:mod:`hybridzero.rlhf.settings`).

Every settings field ``name`` is a flag ``--name`` (``--name-with-dashes`` too; :func:`add_settings_arguments`).
Booleans take an optional value (``--enable_ema`` or ``--enable_ema false``). ``--config FILE`` reads a JSON
object of settings first; flags given on the command line override it. DeepSpeed-Chat flags that hybridzero does
not implement are accepted only at their DeepSpeed-Chat default (a no-op); any other value is an error naming the
flag and why. Launcher and config flags (``--local_rank``, ``--deepspeed``, ``--deepspeed_config``, ``--deepscale``,
``--deepscale_config``) are accepted and ignored.

Invariant: bad settings are refused with one ``ValueError`` naming the keys and values and what would be valid
(:func:`settings_from_args`), before any process group exists.
"""

from __future__ import annotations

import argparse
import difflib
import json
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from hybridzero.argtypes import path_text
from hybridzero.rlhf.settings import (
    GRPO_ALIASES,
    GRPOSettings,
)

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
