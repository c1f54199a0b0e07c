"""Hostile model directories, ``export`` arguments and format-1 checkpoints, table-driven (issue 28).

``from_pretrained``: a malformed directory (config, index escaping the directory, missing or truncated shards, an
integer tensor where the model has a float parameter) raises the named error type naming the file or tensor, the
directory unchanged. ``hybridzero export``: bad arguments end in one error line, nothing written. ``hybridzero
convert-checkpoint`` on crafted pickles: refused naming the file and the blocked global, nothing runs or is written.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from hybridzero.cli import main
from tests.harness.format1 import downgrade
from tests.harness.models import tiny_llama
from tests.harness.parity import RunSpec
from tests.hostile.forge import TAG, copy_tree, digest
from tests.workers.ckpt_trust import save_tag
from tests.workers.hostile_ckpt import from_pretrained_cases

SPEC = RunSpec(model="opt", steps=3, optimizer="client", scheduler=True)


# --- from_pretrained of hostile model directories -------------------------------------------------------------
VICTIM = "model.layers.1.self_attn.o_proj.weight"


def _retyped(dtype: torch.dtype) -> Any:
    def make(d: Path, state: dict[str, torch.Tensor]) -> None:
        state[VICTIM] = state[VICTIM].to(dtype)
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})

    return make


def _indexed(weight_map: Any) -> Any:
    def make(d: Path, state: dict[str, torch.Tensor]) -> None:
        save_file(state, str(d / "part.safetensors"), metadata={"format": "pt"})
        (d / "model.safetensors").unlink()
        wm = {k: "part.safetensors" for k in state} if weight_map is None else weight_map
        if isinstance(wm, dict):
            wm = {**{k: "part.safetensors" for k in state}, **wm}
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))

    return make


def _config(text: str | None) -> Any:
    def make(d: Path, state: dict[str, torch.Tensor]) -> None:
        if text is None:
            (d / "config.json").unlink()
        else:
            (d / "config.json").write_text(text)

    return make


def _extra_tensor(d: Path, state: dict[str, torch.Tensor]) -> None:
    save_file({**state, "evil.weight": torch.ones(3)}, str(d / "model.safetensors"), metadata={"format": "pt"})


def _truncated(d: Path, state: dict[str, torch.Tensor]) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:300])


PRETRAINED_CASES: dict[str, tuple[Any, str, tuple[str, ...]]] = {
    "int32_tensor": (_retyped(torch.int32), "ValueError", (VICTIM, "int32", "floating-point")),
    "bool_tensor": (_retyped(torch.bool), "ValueError", (VICTIM, "bool", "floating-point")),
    "int64_tensor": (_retyped(torch.int64), "ValueError", (VICTIM, "int64", "floating-point")),
    "index_dotdot": (_indexed({VICTIM: "../outside.safetensors"}), "CheckpointFileError", ("../outside", "leaves")),
    "index_absolute": (_indexed({VICTIM: "/etc/passwd"}), "CheckpointFileError", ("/etc/passwd", "leaves")),
    "index_missing_shard": (_indexed({VICTIM: "gone.safetensors"}), "FileNotFoundError", ("gone.safetensors",)),
    "index_not_a_map": (_indexed([1, 2]), "CheckpointFileError", ("model.safetensors.index.json",)),
    "config_malformed": (_config("{not json"), "OSError", ("config.json",)),
    "config_missing": (_config(None), "ValueError", ("config.json",)),
    "extra_tensor": (_extra_tensor, "ValueError", ("unexpected 'evil.weight'",)),
    "truncated_weights": (_truncated, "CheckpointFileError", ("model.safetensors",)),
}


@pytest.fixture(scope="module")
def pretrained(world, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("hostile_pretrained")
    model = tiny_llama(seed=0)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    names = sorted(PRETRAINED_CASES)
    paths, before = [], {}
    for name in names:
        d = base / name
        model.save_pretrained(d, safe_serialization=True)
        PRETRAINED_CASES[name][0](d, dict(state))
        before[name] = digest(d)
        paths.append(str(d))
    out = world(1).run(from_pretrained_cases, paths, timeout=600)[0]
    return {n: (out[i], digest(base / n) == before[n]) for i, n in enumerate(names)}


@pytest.mark.parametrize("name", sorted(PRETRAINED_CASES))
def test_hostile_model_directory_is_refused(pretrained: dict[str, Any], name: str) -> None:
    error, unchanged = pretrained[name]
    _, kind, needles = PRETRAINED_CASES[name]
    assert error.split(":")[0] == kind, error
    assert all(n in error for n in needles), (needles, error)
    assert unchanged and not os.path.exists(Path(os.sep) / "outside.safetensors")


# --- hybridzero export arguments ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good(world, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A world-2 checkpoint of SPEC after one step (never modified)."""
    root = tmp_path_factory.mktemp("good")
    world(2).run(save_tag, SPEC, str(root), TAG, 1)
    return root


# name -> (arguments after "export" with CKPT/OUT placeholders, exit status, substrings of stderr)
EXPORT_CASES: dict[str, tuple[list[str], int, tuple[str, ...]]] = {
    "dtype_int8": (["CKPT", "OUT", "--dtype", "int8"], 2, ("--dtype", "'int8'")),
    "shard_size_inf": (["CKPT", "OUT", "--max-shard-size", "1e400"], 2, ("--max-shard-size", "'1e400'")),
    "shard_size_negative": (["CKPT", "OUT", "--max-shard-size", "-5"], 2, ("--max-shard-size", "'-5'")),
    "shard_size_unit": (["CKPT", "OUT", "--max-shard-size", "5KBKB"], 2, ("--max-shard-size", "'5KBKB'")),
    "lora_mode": (["CKPT", "OUT", "--lora", "weird"], 2, ("--lora", "'weird'")),
    "out_is_a_file": (["CKPT", "FILE"], 1, ("FILE", "not an empty directory")),
    "out_is_the_checkpoint": (["CKPT", "CKPT"], 1, ("CKPT", "not an empty directory")),
    "missing_checkpoint": (["CKPT/nope", "OUT"], 1, ("CKPT/nope",)),
    "unknown_tag": (["CKPT", "OUT", "--tag", "global_step9"], 1, ("'global_step9'", "['global_step1']")),
    "tag_with_newline": (["CKPT", "OUT", "--tag", "a\nb"], 1, ("invalid checkpoint tag",)),
    "adapters_without_lora": (["CKPT", "OUT", "--adapters", "ADP"], 1, ("no LoRA adapters",)),
}


@pytest.mark.parametrize("name", sorted(EXPORT_CASES))
def test_hostile_export_arguments(good: Path, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    args, status, needles = EXPORT_CASES[name]
    (tmp_path / "file").write_text("not a directory")
    paths = {
        "CKPT": str(good),
        "OUT": str(tmp_path / "out"),
        "FILE": str(tmp_path / "file"),
        "ADP": str(tmp_path / "a"),
    }

    def fill(text: str) -> str:
        for k, v in paths.items():
            text = text.replace(k, v)
        return text

    before = (digest(good), digest(tmp_path))
    try:
        code = main(["export", *map(fill, args)])
    except SystemExit as exc:  # argparse's own refusals
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == status and all(fill(n) in err for n in needles), (code, needles, err)
    assert (digest(good), digest(tmp_path)) == before


# --- format-1 conversion of crafted pickles -------------------------------------------------------------------
class Reduce:
    """Pickles as ``fn(*args)``: what a crafted ``.pt`` file would call when unpickled."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def _payloads(marker: Path) -> dict[str, Reduce]:
    return {
        "os.system": Reduce(os.system, f"touch {marker}"),
        "builtins.eval": Reduce(eval, f"open({str(marker)!r}, 'w')"),
        "builtins.exec": Reduce(exec, f"open({str(marker)!r}, 'w')"),
        "subprocess.Popen": Reduce(subprocess.Popen, ["touch", str(marker)]),
        "io.open": Reduce(io.open, str(marker), "w"),
        "shutil.rmtree": Reduce(shutil.rmtree, str(marker.parent)),
    }


# name -> (file replaced, payload, what the message must name: the GLOBAL as written in the file; pickle protocol 2
# writes subprocess.Popen under its Python-2 name commands.Popen)
CONVERT_CASES = {
    "os_system_in_rank0": ("rank_00000.pt", "os.system", "os.system"),
    "eval_in_rank1": ("rank_00001.pt", "builtins.eval", "builtins.eval"),
    "exec_in_extra": ("extra.pt", "builtins.exec", "builtins.exec"),
    "popen_in_extra": ("extra.pt", "subprocess.Popen", "'commands.Popen'"),
    "open_in_rank0": ("rank_00000.pt", "io.open", "io.open"),
    "rmtree_in_rank1": ("rank_00001.pt", "shutil.rmtree", "shutil.rmtree"),
}


@pytest.fixture(scope="module")
def v1(good: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``good`` in the old pickle-based format 1."""
    out = tmp_path_factory.mktemp("v1")
    downgrade(good, TAG, out)
    return out


@pytest.mark.parametrize("name", sorted(CONVERT_CASES))
def test_crafted_format1_pickle_is_refused_naming_the_global(
    v1: Path, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 28: the refusal lost the name of the blocked global (torch's wording changed)."""
    target, payload, blocked = CONVERT_CASES[name]
    old, marker = copy_tree(v1, tmp_path / "old"), tmp_path / "pwned"
    torch.save({"groups": {}, "rng": _payloads(marker)[payload]}, old / TAG / target)
    before = digest(old)
    assert main(["convert-checkpoint", str(old), str(tmp_path / "new")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("convert-checkpoint: error:") and target in err, err
    assert blocked in err and "weights_only=False" not in err, err
    assert not marker.exists() and not (tmp_path / "new").exists() and digest(old) == before
