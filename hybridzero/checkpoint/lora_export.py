"""LoRA adapters of an engine checkpoint as a peft directory (``PeftModel.from_pretrained`` loads it).

Writes ``adapter_config.json`` and ``adapter_model.safetensors`` as peft saves them (see
:func:`hybridzero.lora.peft_adapter_state` for the name and shape mapping and why ``lora_alpha = 1`` reproduces
DS-Chat's ``1 / r`` scale). The base model the adapters apply to is ``export_hf(..., lora="base")`` of the same
checkpoint (equal to the pretrained model when only the adapters were trained). Adapters are small: they are read
whole. Like :func:`hybridzero.checkpoint.export.export_hf` the directory appears atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from safetensors.torch import save_file

from hybridzero.checkpoint.export import _check_out_dir, _open
from hybridzero.lora import is_lora_name, peft_adapter_state

__all__ = ["ADAPTER_CONFIG_NAME", "ADAPTER_WEIGHTS_NAME", "export_adapters"]

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


def export_adapters(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tag: str | None = None,
    *,
    base_model_name_or_path: str = "",
) -> Path:
    """Write the checkpoint's LoRA adapters (fp32) as a peft directory; ValueError if it has none."""
    out = Path(out_dir)
    _check_out_dir(out)
    meta, source = _open(ckpt_dir, tag)
    state = {
        name: source.read_flat(name, 0, int(info["numel"])).view(tuple(info["shape"]))
        for name, info in meta["params"].items()
        if is_lora_name(name)
    }
    tensors, config = peft_adapter_state(state, base_model_name_or_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.adapters-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        (tmp / ADAPTER_CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        _check_out_dir(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
