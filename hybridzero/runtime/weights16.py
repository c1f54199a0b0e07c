"""DeepSpeed's ``save_16bit_model``: the consolidated module weights in the compute dtype, written by rank 0.

Invariant: every rank calls it; the outcome (True, False at stage 3 without the gather flag, or an error) is the same
on every rank; the file appears atomically (written under a temporary name, then renamed).
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybridzero.checkpoint.paths import PARTIAL, check_tag
from hybridzero.runtime.checkpointing import Checkpointable, agree, describe
from hybridzero.zero.partition import param_aliases

_LOG = logging.getLogger("hybridzero")


def save_16bit_model(
    engine: Checkpointable,
    full: dict[str, torch.Tensor] | None,
    save_dir: str | os.PathLike[str],
    save_filename: str = "pytorch_model.bin",
    exclude_frozen_parameters: bool = False,
) -> bool:
    """DeepSpeed's ``save_16bit_model``: the module's consolidated ``state_dict`` (every parameter name, tied ones
    included, in the compute dtype, plus persistent buffers) written by rank 0 to ``save_dir/save_filename`` —
    ``torch.save`` format, or safetensors when the name ends in ``.safetensors``. ``full`` is the engine's
    ``full_parameters()`` (gathered by the caller on every rank), or None at stage 3 without
    ``stage3_gather_16bit_weights_on_model_save``: then, as DeepSpeed does, nothing is written and False returned."""
    if full is None:
        if engine.comm.rank == 0:
            _LOG.warning(
                "save_16bit_model: zero_optimization.stage3_gather_16bit_weights_on_model_save is false, "
                "nothing saved (DeepSpeed behaviour); enable it, or use save_checkpoint + hybridzero export"
            )
        return False
    error = None
    if engine.comm.rank == 0:
        try:
            check_tag(save_filename, where="save_filename")
            trainable = {s.spec.name: s.trainable for g in engine.groups for s in g.slots}
            out: dict[str, torch.Tensor] = {}
            params = set()
            for first, names in param_aliases(engine.module).items():
                params.update(names)
                if exclude_frozen_parameters and not trainable[first]:
                    continue
                value = full[first].to(engine.compute_dtype)
                for name in names:
                    out[name] = value
            for name, t in engine.module.state_dict(keep_vars=True).items():
                if name not in params and isinstance(t, torch.Tensor):
                    out[name] = t.detach().cpu().clone()
            _write_weights(Path(save_dir), save_filename, out)
        except (OSError, TypeError, ValueError, RuntimeError) as exc:
            error = describe(exc)
    agree(engine.comm, error, f"save_16bit_model({str(save_dir)!r}, {save_filename!r})")
    return True


def _write_weights(root: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Atomically write ``tensors`` to ``root/name`` (safetensors needs distinct storage per name: tied copies)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}{PARTIAL}{uuid.uuid4().hex}"
    try:
        if name.endswith(".safetensors"):
            save_file(
                {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()},
                str(tmp),
                metadata={"format": "pt"},
            )
        else:
            torch.save({k: v.detach().cpu() for k, v in tensors.items()}, tmp)
        os.replace(tmp, root / name)
    finally:
        tmp.unlink(missing_ok=True)
