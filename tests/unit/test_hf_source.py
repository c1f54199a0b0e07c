"""Tests for hybridzero.checkpoint.hf_source: slice-wise reads of HF safetensors checkpoints."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from hybridzero.checkpoint import hf_source
from hybridzero.checkpoint.hf_source import (
    CheckpointFileError,
    HFCheckpointSource,
    ModuleSource,
    TensorSource,
    resolve_name,
)
from tests.harness.models import tiny_llama


# --- helpers
def _llama() -> transformers.PreTrainedModel:
    return tiny_llama(seed=0).eval()  # the project's tiny GQA Llama (no second copy of its dims here)


def _gpt2() -> transformers.PreTrainedModel:
    torch.manual_seed(1)
    config = transformers.GPT2Config(
        vocab_size=97,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )
    return transformers.GPT2LMHeadModel(config).eval()


def _ranges(shape: torch.Size, rng: random.Random) -> list[tuple[int, int]]:
    """Empty, whole, single-element, row-crossing and random ranges for a tensor of ``shape``."""
    n = shape.numel()
    out = [(0, 0), (n, n), (0, n), (0, 1), (n - 1, n), (n // 2, n // 2 + 1)]
    if len(shape) >= 2 and shape[0] >= 3:
        row = math.prod(shape[1:])
        out += [(row - 1, row + 1), (row, 2 * row), (row + 1, 2 * row + 1), (1, n - 1)]
    for _ in range(4):
        lo = rng.randrange(n + 1)
        out.append((lo, rng.randrange(lo, n + 1)))
    return out


def _assert_matches_module(src: TensorSource, model: torch.nn.Module) -> int:
    """Every stored parameter read over many ranges equals the module's; returns ranges checked."""
    rng = random.Random(0)
    params = dict(model.named_parameters(remove_duplicate=False))
    checked = 0
    for name in src.names():
        ref = params[name].detach().reshape(-1)
        assert src.shape(name) == params[name].shape
        assert src.dtype(name) == params[name].dtype
        for lo, hi in _ranges(src.shape(name), rng):
            got = src.read_flat(name, lo, hi)
            assert got.dim() == 1 and got.dtype == ref.dtype
            torch.testing.assert_close(got, ref[lo:hi], rtol=0, atol=0)
            checked += 1
    return checked


# --- fixtures
@pytest.fixture(scope="module")
def llama() -> transformers.PreTrainedModel:
    return _llama()


@pytest.fixture(scope="module")
def llama_single(tmp_path_factory: pytest.TempPathFactory, llama: Any) -> Path:
    out = tmp_path_factory.mktemp("llama_single")
    llama.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def llama_sharded(tmp_path_factory: pytest.TempPathFactory, llama: Any) -> Path:
    out = tmp_path_factory.mktemp("llama_sharded")
    llama.save_pretrained(out, safe_serialization=True, max_shard_size="20KB")
    return out


@pytest.fixture()
def custom_file(tmp_path: Path) -> Iterator[tuple[Path, dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "scalar": torch.tensor(2.5),
        "vec": torch.randn(17, generator=gen),
        "cube": torch.randn(5, 4, 3, generator=gen),
        "big": torch.randn(1000, 64, generator=gen),
        "half": torch.randn(7, 9, generator=gen).to(torch.bfloat16),
        "ints": torch.arange(30, dtype=torch.int64).reshape(6, 5),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "custom.safetensors"
    save_file(tensors, str(path))
    yield path, tensors


# --- checkpoint layouts
def test_single_file_llama_matches_module(llama: Any, llama_single: Path) -> None:
    with HFCheckpointSource(llama_single) as src:
        assert set(src.names()) == {n for n, _ in llama.named_parameters()}
        assert _assert_matches_module(src, llama) > 100


def test_sharded_llama_matches_module(llama: Any, llama_sharded: Path) -> None:
    index = json.loads((llama_sharded / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 1, "max_shard_size must force several shard files"
    assert all((llama_sharded / f).is_file() for f in shard_files)
    assert not (llama_sharded / "model.safetensors").exists()
    with HFCheckpointSource(llama_sharded) as src:
        assert set(src.names()) == {n for n, _ in llama.named_parameters()}
        _assert_matches_module(src, llama)


def test_single_file_path_and_odd_shapes(custom_file: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, tensors = custom_file
    rng = random.Random(1)
    with HFCheckpointSource(path) as src:
        assert src.names() == sorted(tensors)
        for name, ref in tensors.items():
            assert src.shape(name) == ref.shape and src.dtype(name) == ref.dtype
            for lo, hi in _ranges(ref.shape, rng) if ref.numel() else [(0, 0)]:
                got = src.read_flat(name, lo, hi)
                assert got.shape == (hi - lo,) and got.dtype == ref.dtype
                assert torch.equal(got, ref.reshape(-1)[lo:hi])
        assert torch.equal(src.read_flat("scalar", 0, 1), torch.tensor([2.5]))


def test_result_is_fresh_not_a_view(custom_file: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, tensors = custom_file
    with HFCheckpointSource(path) as src:
        first = src.read_flat("cube", 5, 20)
        first.fill_(0.0)
        assert torch.equal(src.read_flat("cube", 5, 20), tensors["cube"].reshape(-1)[5:20])


def test_bytes_read_covers_only_needed_rows(
    custom_file: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, _ = custom_file
    row_bytes = 64 * 4
    with HFCheckpointSource(path) as src:
        assert src.bytes_read() == 0
        src.read_flat("big", 500 * 64 + 10, 500 * 64 + 20)  # inside one row
        assert src.bytes_read() == row_bytes
        src.read_flat("big", 3 * 64 - 1, 5 * 64 + 1)  # rows 2..5
        assert src.bytes_read() == row_bytes + 4 * row_bytes
        src.read_flat("big", 7, 7)  # empty: reads nothing
        assert src.bytes_read() == 5 * row_bytes
        src.read_flat("vec", 3, 9)  # 1-D: exactly the elements
        assert src.bytes_read() == 5 * row_bytes + 6 * 4
        assert src.bytes_read() < 1000 * row_bytes // 100


def test_shard_files_opened_once_and_lazily(llama_sharded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real: Callable[..., Any] = hf_source.safe_open

    def counting(path: str, framework: str) -> Any:
        opened.append(path)
        return real(path, framework=framework)

    monkeypatch.setattr(hf_source, "safe_open", counting)
    with HFCheckpointSource(llama_sharded) as src:
        assert opened == []
        for name in src.names():
            src.read_flat(name, 0, 1)
            src.read_flat(name, 0, src.shape(name).numel())
        assert len(opened) == len(set(opened)) > 1
    with pytest.raises(RuntimeError, match="closed"):
        src.read_flat(src.names()[0], 0, 1)


# --- tied weights and aliases
def test_tied_gpt2_resolves_to_embedding(tmp_path: Path) -> None:
    model = _gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    model.save_pretrained(tmp_path, safe_serialization=True)
    with HFCheckpointSource(tmp_path) as src:
        assert "lm_head.weight" not in src.names()
        name = resolve_name(src, ["lm_head.weight", "transformer.wte.weight"])
        assert name == "transformer.wte.weight"
        n = src.shape(name).numel()
        assert torch.equal(src.read_flat(name, 0, n), model.lm_head.weight.detach().reshape(-1))
        _assert_matches_module(src, model)
    module_src = ModuleSource(model)
    assert resolve_name(module_src, ["lm_head.weight", "transformer.wte.weight"]) == "lm_head.weight"


def test_resolve_name_missing_lists_aliases_path_and_close_names(llama_single: Path) -> None:
    with HFCheckpointSource(llama_single) as src:
        with pytest.raises(KeyError) as info:
            resolve_name(src, ["model.embed_token.weight", "lm_head.weights"])
        msg = str(info.value)
        assert "model.embed_token.weight" in msg and "lm_head.weights" in msg
        assert str(llama_single) in msg
        assert "model.embed_tokens.weight" in msg and "'lm_head.weight'" in msg
        with pytest.raises(ValueError):
            resolve_name(src, [])


def test_module_source_matches_and_copies(llama: Any) -> None:
    src = ModuleSource(llama)
    assert src.names() == [n for n, _ in llama.named_parameters(remove_duplicate=False)]
    _assert_matches_module(src, llama)
    got = src.read_flat("model.norm.weight", 0, 3)
    got.fill_(123.0)
    assert not torch.equal(llama.model.norm.weight.detach()[:3], got)
    with pytest.raises(KeyError, match="nope"):
        src.read_flat("nope", 0, 1)
    with pytest.raises(ValueError):
        src.read_flat("model.norm.weight", 0, 36)


# --- errors
def test_unknown_name_and_bad_ranges(custom_file: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = custom_file
    with HFCheckpointSource(path) as src:
        for call in (src.shape, src.dtype, lambda n: src.read_flat(n, 0, 1)):
            with pytest.raises(KeyError, match="missing.weight") as info:
                call("missing.weight")
            assert str(path) in str(info.value)
        n = src.shape("cube").numel()
        for lo, hi in [(-1, 2), (0, n + 1), (5, 4), (n + 1, n + 1)]:
            with pytest.raises(ValueError, match="cube"):
                src.read_flat("cube", lo, hi)
        with pytest.raises(ValueError):
            src.read_flat("cube", 0.0, 1)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            src.read_flat("scalar", 0, 2)


def test_truncated_file_names_the_file(custom_file: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = custom_file
    size = path.stat().st_size
    for keep in (size - 100, 5):
        with open(path, "r+b") as fh:
            fh.truncate(keep)
        with HFCheckpointSource(path) as src:
            with pytest.raises(CheckpointFileError, match="custom.safetensors"):
                src.read_flat("vec", 0, 1)


def test_missing_shard_and_missing_checkpoint(llama: Any, tmp_path: Path) -> None:
    llama.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / victim).unlink()
    with pytest.raises(FileNotFoundError, match=victim):
        HFCheckpointSource(tmp_path)
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        HFCheckpointSource(tmp_path / "does-not-exist")


def test_empty_directory_and_bad_index(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        HFCheckpointSource(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointFileError, match="index.json"):
        HFCheckpointSource(tmp_path)


# --- trust: index file names stay inside the directory; the model's shapes are checked
@pytest.mark.parametrize(
    "name", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", "a\nb", "C:\\x.safetensors", "", "./"]
)
def test_index_file_names_cannot_leave_the_directory(tmp_path: Path, name: str) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file({"w": torch.ones(3)}, str(tmp_path / "outside.safetensors"))  # a real file the index points at
    index = {"metadata": {}, "weight_map": {"w": name}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointFileError, match="leaves the checkpoint directory|non-empty string"):
        HFCheckpointSource(model_dir)


def _expected(model: torch.nn.Module) -> dict[str, tuple[list[str], torch.Size]]:
    from hybridzero.zero.partition import param_aliases

    shapes = dict(model.named_parameters())
    return {first: (names, shapes[first].shape) for first, names in param_aliases(model).items()}


def test_check_against_model_accepts_a_saved_model(llama: Any, llama_sharded: Path) -> None:
    with HFCheckpointSource(llama_sharded) as src:
        hf_source.check_against_model(src, _expected(llama))


@pytest.mark.parametrize("damage", ["transposed", "oversized", "missing", "unexpected"])
def test_check_against_model_names_the_bad_tensor(llama: Any, tmp_path: Path, damage: str) -> None:
    state = {k: v.detach().clone().contiguous() for k, v in llama.state_dict().items()}
    victim = "model.layers.0.mlp.up_proj.weight"
    if damage == "transposed":
        state[victim] = state[victim].t().contiguous()
    elif damage == "oversized":
        state[victim] = torch.cat([state[victim], state[victim][:1]])
    elif damage == "missing":
        del state[victim]
    else:
        victim = "model.layers.0.mlp.extra.weight"
        state[victim] = torch.ones(5)
    save_file(state, str(tmp_path / "model.safetensors"))
    with HFCheckpointSource(tmp_path) as src, pytest.raises(ValueError, match=victim.replace(".", r"\.")):
        hf_source.check_against_model(src, _expected(llama))
