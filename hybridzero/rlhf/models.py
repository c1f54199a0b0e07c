"""The RLHF models: causal-LM actors and value models (reward model, critic), their tokenizer, and their on-disk form.

``model_name_or_path = "demo"`` builds the demo's tiny Llama from its config (seeded, trained from scratch) with the
demo tokenizer (:mod:`hybridzero.rlhf.data.demo_task`). Dropout: step 3's actor, reference and EMA are read with every
dropout at 0 (:func:`dropout_overrides`), so their log-probabilities are deterministic; steps 1-2 train with
DeepSpeed-Chat's ``--dropout`` (:func:`set_dropout`; unset keeps the model's own) and step 1 saves its config with
dropout 0; a value model (reward model, critic) otherwise keeps its config's dropout.

A **value model** is a causal LM's trunk (``AutoModel``: no LM head) plus a value head of ``hidden_size`` weights:
``value[b, t] = <hidden[b, t], v_head>``; a reward model's score is the value at the last real token
(:func:`last_token_index`), a critic's values are read at every position. The head is an elementwise product and a
sum, not ``nn.Linear(h, 1)``, whose CPU matrix-vector rounding depends on the weight's address alignment (a sharded
engine binds parameters as views at arbitrary offsets): elementwise ops round the same everywhere.

On disk a value model is a Hugging Face directory: ``config.json`` of the causal LM it came from,
``value_model.safetensors`` (keys ``transformer.*`` and ``v_head``), the tokenizer files, and ``value_model.json``
naming the format. A causal LM is a plain HF directory (``config.json`` + ``model.safetensors``). Every rank calls
the savers (they gather), rank 0 writes; files are written in ``DIR.partial`` and moved in one by one (a run's
logs in the same directory stay).

Positions always come from the attention mask (:func:`position_ids`): left-padded prompts get the positions a
right-padded copy would have, in generation and in every scoring pass alike (HF's Llama uses ``arange`` when a
forward gets no ``position_ids``, which would score left-padded rows at shifted positions).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, cast

import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from hybridzero.lora import merged_weights
from hybridzero.rlhf.data.demo_task import build_tokenizer, demo_model_config
from hybridzero.runtime.engine import Engine

__all__ = [
    "VALUE_MODEL_FILE",
    "ModelLoadError",
    "ValueHeadModel",
    "check_loadable",
    "dropout_overrides",
    "set_dropout",
    "is_value_model_dir",
    "last_token_index",
    "load_causal_lm",
    "load_tokenizer",
    "load_value_model",
    "position_ids",
    "save_causal_lm",
    "save_value_model",
    "write_value_model",
]

VALUE_MODEL_FILE = "value_model.safetensors"
_MARKER = "value_model.json"
_FORMAT = "hybridzero-value-model-v1"


_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    VALUE_MODEL_FILE,
)


class ModelLoadError(ValueError):
    """A model path or Hub id that cannot be loaded; the message is one line naming it and why."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def check_loadable(path: str, what: str, causal: bool = True) -> None:
    """Raise :class:`ModelLoadError` (one line: ``what``, ``path`` and why) unless ``path`` is ``"demo"``, a local
    model directory with a config and weights, or a Hub id whose config loads (the Hub's cache, or the network).
    ``causal``: the config must be a causal LM's (a saved value model also passes)."""
    if path == "demo":
        return
    local = Path(path)
    if local.exists():
        if not (local / "config.json").is_file():
            raise ModelLoadError(
                f"{what} {path!r}: no config.json in that directory; expected a Hugging Face model "
                "directory (config.json, weights, tokenizer)"
            )
        if not any((local / name).is_file() for name in _WEIGHT_FILES):
            raise ModelLoadError(f"{what} {path!r}: no weights (none of {', '.join(_WEIGHT_FILES)})")
    elif local.is_absolute() or path.startswith(".") or path.count("/") > 1:
        raise ModelLoadError(f"{what} {path!r}: no such directory")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        offline = " (offline: HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""
        where = "" if local.exists() else ": not a local directory, and"
        raise ModelLoadError(f"{what} {path!r}{where} cannot be loaded{offline}: {_first_line(exc)}") from None
    if (
        causal
        and not is_value_model_dir(path)
        and type(hf_config) not in transformers.AutoModelForCausalLM._model_mapping
    ):  # HF's registry of causal-LM configs (private attribute)
        raise ModelLoadError(
            f"{what} {path!r} is not a causal LM (its config is {type(hf_config).__name__}, "
            f"model_type {hf_config.model_type!r})"
        )


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int64: ``cumsum(mask) - 1`` clamped at 0 (the first real token is position 0; pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


_mask_positions = position_ids  # ValueHeadModel.forward's own ``position_ids`` argument shadows the function


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: the index of each row's last real token (``attention_mask`` 1); 0 for an all-pad row."""
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), positions, torch.zeros_like(positions)).max(dim=-1).values


class ValueHeadModel(nn.Module):
    """``transformer`` (an HF ``AutoModel`` trunk) and ``v_head`` (``hidden_size`` weights); see module docstring."""

    def __init__(
        self, hf_config: PretrainedConfig, *, transformer: nn.Module | None = None, head_seed: int = 0
    ) -> None:
        """Build the trunk from ``hf_config`` (or take ``transformer``); head ``N(0, 1/h)`` from ``head_seed``."""
        super().__init__()
        self.transformer = transformer if transformer is not None else transformers.AutoModel.from_config(hf_config)
        # the trunk's own config (from_pretrained copies the one it is given and resolves the attention
        # implementation on the copy): sequence parallelism switches the attention through this object
        self.config = cast(PretrainedConfig, getattr(self.transformer, "config", hf_config))
        width = _head_width(hf_config)
        device = next(self.transformer.parameters()).device
        if device.type == "meta":
            self.v_head = nn.Parameter(torch.empty(width, device="meta"))
        else:
            generator = torch.Generator().manual_seed(head_seed)
            self.v_head = nn.Parameter(torch.randn(width, generator=generator) * width**-0.5)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **varlen: Any,
    ) -> torch.Tensor:
        """Values ``[B, T]`` in fp32 at every position (no KV cache). Positions come from a ``[B, T]`` mask unless
        ``position_ids`` is given (packed rows: a 4D block-causal mask, or flash's ``varlen`` kwargs, passed on)."""
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        positions = position_ids if position_ids is not None else _mask_positions(mask)
        hidden = self.transformer(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False, **varlen
        ).last_hidden_state
        return (hidden.float() * self.v_head.float()).sum(-1)

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B]`` fp32: the value at each row's last real token (the reward model's score)."""
        values = self.forward(input_ids, attention_mask)
        index = last_token_index(attention_mask)
        return values.gather(1, index[:, None]).squeeze(1)

    def gradient_checkpointing_enable(self) -> None:
        """Activation checkpointing in the trunk (HF's own, non-reentrant)."""
        cast(Any, self.transformer).gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )


def _head_width(hf_config: PretrainedConfig) -> int:
    """The trunk's output width: OPT projects to ``word_embed_proj_dim``; others end at ``hidden_size``."""
    return int(getattr(hf_config, "word_embed_proj_dim", None) or hf_config.hidden_size)


def is_value_model_dir(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` holds a value model written by :func:`save_value_model`."""
    return (Path(path) / _MARKER).is_file()


def load_value_model(
    path: str | os.PathLike[str], *, head_seed: int = 0, dropout: float | None = None, no_dropout: bool = False
) -> ValueHeadModel:
    """A value model from ``path``: a saved value model (trunk and head), or a causal-LM directory (its trunk; the
    head is freshly initialised from ``head_seed``, as DeepSpeed-Chat's step 2 starts from a pretrained LM);
    ``dropout`` as in :func:`set_dropout`; ``no_dropout`` sets every dropout probability the config has to 0
    (:func:`dropout_overrides`: the RLHF critic and reward model, whose values must be deterministic)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json; expected a Hugging Face model directory")
    hf_config = set_dropout(transformers.AutoConfig.from_pretrained(path), dropout)
    if no_dropout:
        for key, value in dropout_overrides(hf_config).items():
            setattr(hf_config, key, value)
    if is_value_model_dir(path):
        model = ValueHeadModel(hf_config, head_seed=head_seed)
        state = load_file(str(path / VALUE_MODEL_FILE))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path / VALUE_MODEL_FILE}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
        return model
    lm = transformers.AutoModelForCausalLM.from_pretrained(path, config=hf_config, dtype=torch.float32)
    return ValueHeadModel(hf_config, transformer=lm.base_model, head_seed=head_seed)


def _commit_dir(tmp: Path, out: Path) -> None:
    """Move every file of ``tmp`` into ``out`` (replacing same-named files; a run's logs beside the model stay)."""
    out.mkdir(parents=True, exist_ok=True)
    for item in tmp.iterdir():
        target = out / item.name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(item, target)
    tmp.rmdir()


def _with_architectures(hf_config: PretrainedConfig) -> PretrainedConfig:
    """``hf_config``, or a copy naming its causal-LM class in ``architectures`` when it names none (a model built
    from a config), so ``AutoModelForCausalLM`` and other tools load the directory."""
    if getattr(hf_config, "architectures", None):
        return hf_config
    mapping = transformers.AutoModelForCausalLM._model_mapping  # HF's registry of causal-LM classes (private attribute)
    model_class = mapping.get(type(hf_config), None)
    if model_class is None:
        return hf_config
    named = copy.deepcopy(hf_config)
    named.architectures = [str(getattr(model_class, "__name__"))]  # noqa: B009 - a class; transformers types it loosely
    return named


def _write_dir(
    out: Path,
    files: dict[str, dict[str, torch.Tensor]],
    hf_config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    extra_json: dict[str, Any] | None,
    dtype: torch.dtype,
) -> None:
    """Write safetensors ``files``, ``config.json``, tokenizer and ``extra_json`` into ``out`` atomically."""
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name, state in files.items():
        save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(tmp / name), metadata={"format": "pt"})
    _with_architectures(hf_config).save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if extra_json is not None:
        (tmp / _MARKER).write_text(json.dumps(extra_json, indent=2) + "\n")
    _commit_dir(tmp, out)


def save_causal_lm(
    engine: Engine,
    out_dir: str | os.PathLike[str],
    hf_config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write the engine's causal LM as a Hugging Face directory (every rank calls; rank 0 writes)."""
    state = merged_weights(engine.full_parameters())  # collective; LoRA adapters folded in (DS-Chat's save)
    out = Path(out_dir)
    if engine.comm.rank == 0:
        _write_dir(out, {"model.safetensors": state}, hf_config, tokenizer, None, dtype)
    engine.comm.barrier(phase="save")
    return out


_MARKER_JSON = {
    "format": _FORMAT,
    "weights": VALUE_MODEL_FILE,
    "trunk_prefix": "transformer.",
    "head": "v_head",
    "score": "value at the last token whose attention_mask is 1",
}


def write_value_model(
    model: ValueHeadModel,
    out_dir: str | os.PathLike[str],
    tokenizer: PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write an unsharded :class:`ValueHeadModel` (one process; e.g. a freshly initialised reward model)."""
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    out = Path(out_dir)
    _write_dir(out, {VALUE_MODEL_FILE: state}, model.config, tokenizer, _MARKER_JSON, dtype)
    return out


def save_value_model(
    engine: Engine,
    out_dir: str | os.PathLike[str],
    tokenizer: PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write the engine's :class:`ValueHeadModel` (every rank calls; rank 0 writes); see module docstring."""
    module = engine.module
    if not isinstance(module, ValueHeadModel):
        raise TypeError(f"save_value_model needs an engine wrapping a ValueHeadModel, got {type(module).__name__}")
    state = merged_weights(engine.full_parameters())  # collective; LoRA adapters folded in (DS-Chat's save)
    out = Path(out_dir)
    if engine.comm.rank == 0:
        _write_dir(out, {VALUE_MODEL_FILE: state}, module.config, tokenizer, _MARKER_JSON, dtype)
    engine.comm.barrier(phase="save")
    return out


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a model directory, or the demo tokenizer for ``"demo"``; prompts are left-padded."""
    tok = build_tokenizer() if path == "demo" else transformers.AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    return tok


def add_eot_token(tok: PreTrainedTokenizerBase, eot: str) -> None:
    """DeepSpeed-Chat's ``--add_eot_token``: ``eot`` becomes one special token that ends every answer. Our answers
    end with the tokenizer's eos, so ``eot`` becomes the eos (added to the vocabulary if new); the saved tokenizer
    carries it to the next step, and step 3 stops generating at it."""
    tok.add_special_tokens({"eos_token": eot})


def fit_embeddings(model: nn.Module, vocab: int, seed: int) -> int:
    """Grow an HF model's token embeddings (and tied / output ones) to cover ``vocab`` ids, rounded up to a multiple
    of 8 as DeepSpeed-Chat does; new rows are drawn by the model's own init under ``seed`` (every rank alike). Returns
    the embedding count (unchanged when it already covers ``vocab``)."""
    hf = cast(Any, model)
    have = int(hf.get_input_embeddings().num_embeddings)
    if have >= vocab:
        return have
    torch.manual_seed(seed)
    hf.resize_token_embeddings(8 * math.ceil(vocab / 8), mean_resizing=False)
    return int(hf.get_input_embeddings().num_embeddings)


def load_causal_lm(
    path: str, tokenizer: PreTrainedTokenizerBase, seed: int, dropout: float | None = None
) -> tuple[nn.Module, PretrainedConfig]:
    """``(model, hf_config)``: the demo model built from scratch (seeded) for ``"demo"``, else the HF directory; the
    model trains with ``dropout`` as in :func:`set_dropout`, the returned config (what is saved) has dropout 0."""
    if path == "demo":
        hf_config = demo_model_config(tokenizer)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(set_dropout(copy.deepcopy(hf_config), dropout))
    else:
        hf_config = transformers.AutoConfig.from_pretrained(path)
        run_config = set_dropout(transformers.AutoConfig.from_pretrained(path), dropout)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, config=run_config, dtype=torch.float32)
    for key, value in dropout_overrides(hf_config).items():
        setattr(hf_config, key, value)
    model.to(torch.float32)
    if fit_embeddings(model, len(tokenizer), seed) != hf_config.vocab_size:  # a token added by --add_eot_token
        hf_config.vocab_size = cast(Any, model).config.vocab_size
    return model, hf_config


_DROPOUT_KEYS: tuple[str, ...] = (
    "dropout",
    "attention_dropout",
    "hidden_dropout",
    "activation_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
)


# the keys DeepSpeed-Chat's ``configure_dropout`` sets from ``--dropout`` (those a config has)
DS_CHAT_DROPOUT_KEYS: tuple[str, ...] = ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout")


def set_dropout(hf_config: PretrainedConfig, dropout: float | None) -> PretrainedConfig:
    """DeepSpeed-Chat's ``--dropout`` (steps 1-2): ``None`` keeps the model's own dropout; a value is set on each of
    :data:`DS_CHAT_DROPOUT_KEYS` the config has. Returns ``hf_config`` (changed in place)."""
    if dropout is not None:
        for key in DS_CHAT_DROPOUT_KEYS:
            if hasattr(hf_config, key):
                setattr(hf_config, key, dropout)
    return hf_config


def dropout_overrides(hf_config: PretrainedConfig) -> dict[str, float]:
    """``{key: 0.0}`` for every dropout probability the config has: RLHF log-probabilities must be deterministic."""
    return {key: 0.0 for key in _DROPOUT_KEYS if isinstance(getattr(hf_config, key, None), float)}
