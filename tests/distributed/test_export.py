"""Export of engine checkpoints: consolidated fp32 tensors and Hugging Face directories that ``from_pretrained``
loads to the engine's exact model; streaming memory; the ``hybridzero export`` command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from hybridzero.checkpoint import export
from hybridzero.checkpoint.export import consolidated_state_dict, export_hf
from hybridzero.cli import main
from tests.harness.parity import RunSpec
from tests.workers.ckpt import edit_json, run_with_checkpoint
from tests.workers.export_checks import (
    export_peak_bytes,
    index_of,
    load_exported,
    logits,
    reference_model,
    save_big_checkpoint,
)

MODELS = ("llama", "gpt2_tied", "opt")
TIED = {"gpt2_tied", "opt"}
TINY_SHARD = 20_000  # bytes: forces several files for every tiny model


@pytest.fixture(scope="module")
def saved(world, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, RunSpec, dict[str, Any]]]:
    """Per model: a world-2 checkpoint after 2 training steps, its spec and the engine's ``full_parameters()``."""
    out = {}
    for model in MODELS:
        spec = RunSpec(model=model, steps=2)
        ckpt = tmp_path_factory.mktemp(f"ckpt-{model}")
        result = world(2).run(run_with_checkpoint, spec, str(ckpt), spec.steps, False)
        out[model] = (ckpt, spec, result[0]["params"])
    return out


def _loads_exactly(out: Path, spec: RunSpec, params: dict[str, torch.Tensor]) -> torch.nn.Module:
    model, info = load_exported(out)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert torch.equal(logits(model), logits(reference_model(spec, params)))
    if spec.model in TIED:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model


@pytest.mark.parametrize("model", MODELS)
def test_consolidated_state_dict_is_full_parameters(saved, model: str) -> None:
    ckpt, _, params = saved[model]
    got = consolidated_state_dict(ckpt)
    assert list(got) == list(params)
    for name, value in params.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], value), name


@pytest.mark.parametrize("model", MODELS)
def test_fp32_export_loads_to_identical_logits(saved, tmp_path: Path, model: str) -> None:
    ckpt, spec, params = saved[model]
    single = export_hf(ckpt, tmp_path / "single")
    assert sorted(p.name for p in single.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((single / "config.json").read_text())["dtype"] == "float32"
    _loads_exactly(single, spec, params)

    sharded = export_hf(ckpt, tmp_path / "sharded", max_shard_bytes=TINY_SHARD)
    index = index_of(sharded)
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(p.name for p in sharded.iterdir()) == sorted(files + ["config.json", "model.safetensors.index.json"])
    assert index["metadata"]["total_size"] == 4 * sum(v.numel() for v in params.values())
    assert index["metadata"]["total_parameters"] == sum(v.numel() for v in params.values())
    # the same files and names save_pretrained writes for this model
    reference_dir = tmp_path / "reference"
    reference_model(spec, params).save_pretrained(reference_dir, max_shard_size=TINY_SHARD)
    assert index["weight_map"] == index_of(reference_dir)["weight_map"]
    _loads_exactly(sharded, spec, params)


@pytest.mark.parametrize("model", MODELS)
def test_bf16_export_holds_the_fp32_weights_cast(saved, tmp_path: Path, model: str) -> None:
    ckpt, spec, params = saved[model]
    out = export_hf(ckpt, tmp_path / "bf16", dtype="bf16", max_shard_bytes=TINY_SHARD)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded, info = load_exported(out)
    assert not any(info.values()), info
    for name, value in params.items():
        got = loaded.get_parameter(name)
        assert got.dtype == torch.bfloat16 and torch.equal(got, value.to(torch.bfloat16)), name
    half = export_hf(ckpt, tmp_path / "fp16", dtype="fp16")
    assert load_exported(half)[0].dtype == torch.float16


def test_export_streams_under_a_memory_budget(world, tmp_path: Path) -> None:
    sizes = world(2).run(save_big_checkpoint, str(tmp_path / "ckpt"), 6)[0]
    model_bytes, largest = 4 * sizes["numel"], 4 * sizes["largest"]
    assert sizes["numel"] >= 20_000_000
    shard = 2 * largest
    small = export_peak_bytes(str(tmp_path / "ckpt"), str(tmp_path / "small"), shard)
    assert len(index_of(tmp_path / "small")["weight_map"]) == 6 * 9 + 3
    # the measurement sees what export holds: exporting into one file holds the whole model
    whole = export_peak_bytes(str(tmp_path / "ckpt"), str(tmp_path / "whole"), 2 * model_bytes)
    print(
        f"model {model_bytes / 2**20:.1f} MiB fp32; peak held: {small['bytes'] / 2**20:.1f} MiB with "
        f"{shard / 2**20:.1f} MiB shards, {whole['bytes'] / 2**20:.1f} MiB into one file"
    )
    assert whole["bytes"] >= model_bytes
    assert small["bytes"] <= shard + largest < 0.5 * model_bytes


def test_export_refuses_bad_input_and_writes_nothing(saved, tmp_path: Path) -> None:
    ckpt, _, _ = saved["opt"]
    with pytest.raises(ValueError, match=r"'fp8'.*fp32, bf16, fp16"):
        export_hf(ckpt, tmp_path / "a", dtype="fp8")
    with pytest.raises(FileNotFoundError, match=r"'nope'.*global_step2"):
        export_hf(ckpt, tmp_path / "a", tag="nope")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        export_hf(ckpt, busy)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    with mock.patch.object(export, "save_file", side_effect=OSError("disk full")), pytest.raises(OSError):
        export_hf(ckpt, tmp_path / "torn", max_shard_bytes=TINY_SHARD)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]  # no partial output, no temporary directory
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (export_hf(ckpt, empty) / "model.safetensors").is_file()  # an empty destination is fine


def test_export_without_hf_config_fails_clearly(saved, tmp_path: Path) -> None:
    ckpt, _, _ = saved["llama"]
    copy = tmp_path / "ckpt"
    (copy / "global_step2").mkdir(parents=True)
    (copy / "latest").write_text("global_step2")
    for item in (ckpt / "global_step2").iterdir():
        shutil.copy(item, copy / "global_step2" / item.name)
    meta = json.loads((copy / "global_step2" / "meta.json").read_text())
    edit_json(copy / "global_step2", "meta.json", lambda m: {**m, "hf_config": None})
    with pytest.raises(ValueError, match="hf_config is null"):
        export_hf(copy, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert set(consolidated_state_dict(copy)) == set(meta["params"])  # the fp32 tensors need no HF config


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "hybridzero", "export", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_cli_export(saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, spec, params = saved["gpt2_tied"]
    ok = _cli(str(ckpt), str(tmp_path / "out"), "--tag", "global_step2", "--max-shard-size", "20KB")
    assert ok.returncode == 0, ok.stderr
    assert "model.safetensors.index.json" in ok.stdout
    assert len(set(index_of(tmp_path / "out")["weight_map"].values())) > 1
    _loads_exactly(tmp_path / "out", spec, params)
    unknown = _cli(str(ckpt), str(tmp_path / "x"), "--tag", "nope")
    assert unknown.returncode == 1 and "'nope'" in unknown.stderr and "global_step2" in unknown.stderr
    # the remaining refusals in-process (same entry point, no interpreter start-up)
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 1
    assert "not an empty directory" in capsys.readouterr().err
    for flag, value in (("--dtype", "fp8"), ("--max-shard-size", "lots")):
        with pytest.raises(SystemExit) as exit_info:
            main(["export", str(ckpt), str(tmp_path / "y"), flag, value])
        assert exit_info.value.code == 2 and value in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
