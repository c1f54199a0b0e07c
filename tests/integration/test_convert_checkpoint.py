"""Converting checkpoints of the old pickle-based format 1 (``hybridzero convert-checkpoint`` /
``hybridzero.checkpoint.convert_v1``): a converted checkpoint loads into a fresh engine bitwise equal to the run that
saved it (world 1 and 2, and resharded to world 1); crafted pickles never run; corrupt or inconsistent files are
refused naming the file with nothing written; OLD_DIR is never written and NEW_DIR is never a foreign directory.

The format-1 fixtures are real engine runs' checkpoints rewritten in the old layout (:mod:`tests.harness.format1`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from hybridzero.checkpoint import CheckpointError, convert_v1, list_tags, verify_tag
from hybridzero.cli import main
from tests.distributed.test_checkpoint_trust import digest
from tests.harness.format1 import downgrade
from tests.harness.parity import RunSpec
from tests.workers.ckpt import load_and_consolidate
from tests.workers.ckpt_trust import Payload, payload_bytes, same
from tests.workers.convert import load_with_snapshot, save_with_snapshot

TAG = "global_step2"
SPECS = {
    1: RunSpec(model="opt", steps=3, optimizer="client", scheduler=True),
    2: RunSpec(model="gpt2_tied", steps=3, dtype="bf16", persistence_threshold=100, scheduler=True),
}


@pytest.fixture(scope="module")
def original(world, tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, list[dict[str, Any]]]]:
    """Per world size: a format-2 checkpoint of SPECS[w] after two steps, and every rank's state at the save."""
    out = {}
    for w, spec in SPECS.items():
        root = tmp_path_factory.mktemp(f"v2_world{w}")
        out[w] = (root, world(w).run(save_with_snapshot, spec, str(root), TAG, timeout=240))
    return out


@pytest.fixture(scope="module")
def v1_pristine(original, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Per world size: the same checkpoint in format 1 (never modified: tests copy it)."""
    out = {}
    for w, (root, _) in original.items():
        out[w] = tmp_path_factory.mktemp(f"v1_world{w}")
        downgrade(root, TAG, out[w])
    return out


@pytest.fixture()
def v1(v1_pristine: dict[int, Path], tmp_path: Path) -> Path:
    """A private copy of the world-2 format-1 checkpoint."""
    return Path(shutil.copytree(v1_pristine[2], tmp_path / "old"))


def _rank_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


# --- a converted checkpoint is the saved run, bit for bit ---------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2])
def test_converted_checkpoint_loads_bitwise_equal(world, original, v1_pristine, tmp_path, world_size, capsys) -> None:
    v2_root, saved = original[world_size]
    new = tmp_path / "new"
    if world_size == 1:  # the command line once, the function once
        assert main(["convert-checkpoint", str(v1_pristine[1]), str(new), "--tag", TAG]) == 0
        assert f"wrote format-2 checkpoint {new / TAG}" in capsys.readouterr().out
    else:
        assert convert_v1(v1_pristine[2], new, tag=TAG) == new / TAG
    assert (new / "latest").read_text() == TAG and verify_tag(new) == new / TAG
    # the same files a save writes: tensors, RNG headers and state bitwise; meta.json adds only its provenance
    for r in range(world_size):
        assert same(
            _rank_tensors(new / TAG / f"rank_{r:05d}.safetensors"),
            _rank_tensors(v2_root / TAG / f"rank_{r:05d}.safetensors"),
        )
    for name in ("state.json", "state.safetensors"):
        assert (new / TAG / name).read_bytes() == (v2_root / TAG / name).read_bytes(), name
    meta = json.loads((new / TAG / "meta.json").read_text())
    assert meta.pop("converted_from") == {"format": 1, "tag": TAG}
    assert meta == json.loads((v2_root / TAG / "meta.json").read_text())

    loaded = world(world_size).run(load_with_snapshot, SPECS[world_size], str(new), timeout=240)
    for r, (before, after) in enumerate(zip(saved, loaded)):
        assert after["path"] == str(new / TAG) and after["client"] == {"note": "format 1", "step": 2}
        assert after["snap"]["counters"] == (2, 2, 0)
        assert same(before["snap"], after["snap"]), f"rank {r}: state differs from the saved run"


def test_converted_world2_checkpoint_reshards_to_world1(world, original, v1_pristine, tmp_path) -> None:
    new = tmp_path / "new"
    convert_v1(v1_pristine[2], new)
    loaded = world(1).run(load_and_consolidate, SPECS[2], str(new), timeout=240)[0]
    saved = original[2][1][0]
    assert loaded["steps"] == 2
    assert same(loaded["params"], saved["params"]) and same(loaded["state"], saved["state"])


def test_loader_refusal_names_the_command(v1: Path) -> None:
    with pytest.raises(CheckpointError, match="old pickle-based format 1") as err:
        verify_tag(v1)
    assert f"hybridzero convert-checkpoint {v1} NEW_DIR --tag {TAG}" in str(err.value)


# --- hostile and damaged input -------------------------------------------------------------------------------------
def refused(old: Path, new: Path, *needles: str, tag: str | None = None) -> str:
    """Convert expecting refusal: the message names ``needles``; OLD_DIR unchanged, NEW_DIR not created."""
    before = digest(old)
    with pytest.raises(CheckpointError) as err:
        convert_v1(old, new, tag)
    message = str(err.value)
    assert all(n in message for n in needles), (needles, message)
    assert "weights_only=False" not in message  # never advises the unsafe load
    assert digest(old) == before and not new.exists()
    return message


def _zip_payload(marker: str) -> bytes:
    path = Path(marker).with_suffix(".pt")
    torch.save({"groups": {}, "rng": Payload(marker)}, path)
    return path.read_bytes()


@pytest.mark.parametrize("target", ["rank_00000.pt", "rank_00001.pt", "extra.pt"])
@pytest.mark.parametrize("make", [_zip_payload, payload_bytes], ids=["torch_save", "raw_pickle"])
def test_crafted_pickle_never_runs(v1: Path, tmp_path: Path, target: str, make: Callable[[str], bytes]) -> None:
    marker = tmp_path / "pwned"
    (v1 / TAG / target).write_bytes(make(str(marker)))
    refused(v1, tmp_path / "new", str(v1 / TAG / target), "refused")
    assert not marker.exists()


def test_crafted_pickle_via_cli(v1: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "pwned"
    (v1 / TAG / "extra.pt").write_bytes(_zip_payload(str(marker)))
    assert main(["convert-checkpoint", str(v1), str(tmp_path / "new")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("convert-checkpoint: error:") and "extra.pt" in err and "'io.open'" in err
    assert not marker.exists() and not (tmp_path / "new").exists()


def _edit_pt(name: str, edit: Callable[[Any], Any]) -> Callable[[Path], None]:
    def apply(tag_dir: Path) -> None:
        obj = torch.load(tag_dir / name, weights_only=True)  # our own fixture file
        torch.save(edit(obj), tag_dir / name)

    return apply


def _edit_meta(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def apply(tag_dir: Path) -> None:
        meta = json.loads((tag_dir / "meta.json").read_text())
        edit(meta)
        (tag_dir / "meta.json").write_text(json.dumps(meta))

    return apply


def _first_sharded(payload: dict[str, Any]) -> dict[str, Any]:
    return next(p for p in payload["groups"].values() if p["lo"] > 0)


def _gap(payload: dict[str, Any]) -> dict[str, Any]:
    part = _first_sharded(payload)
    part["lo"] += 1
    part["tensors"] = {k: t[1:].clone() for k, t in part["tensors"].items()}
    return payload


def _truncate(tag_dir: Path) -> None:
    data = (tag_dir / "rank_00001.pt").read_bytes()
    (tag_dir / "rank_00001.pt").write_bytes(data[: len(data) // 2])


def _symlink(tag_dir: Path) -> None:
    os.replace(tag_dir / "rank_00000.pt", tag_dir.parent / "elsewhere.pt")
    (tag_dir / "rank_00000.pt").symlink_to(tag_dir.parent / "elsewhere.pt")


def _param(meta: dict[str, Any]) -> dict[str, Any]:
    return next(iter(meta["params"].values()))


CORRUPTIONS: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "truncated": (_truncate, "rank_00001.pt", "refused"),
    "world_size_0": (_edit_meta(lambda m: m.update(world_size=0)), "meta.json", "world_size"),
    "world_size_3": (_edit_meta(lambda m: m.update(world_size=3)), "rank_00002.pt", "missing"),
    "world_size_huge": (_edit_meta(lambda m: m.update(world_size=10**12)), "rank_00002.pt", "missing"),
    "world_size_1": (_edit_meta(lambda m: m.update(world_size=1)), "rank_00001.pt", "unexpected"),
    "format_2_meta": (_edit_meta(lambda m: m.update(format=2)), "meta.json", "expected 1"),
    "numel": (_edit_meta(lambda m: _param(m).update(numel=_param(m)["numel"] + 1)), "meta.json", "numel"),
    "offset": (_edit_meta(lambda m: _param(m).update(offset=10**9)), "meta.json", "exceeds group"),
    "gap": (_edit_pt("rank_00001.pt", _gap), "meta.json", "gap"),
    "length": (
        _edit_pt("rank_00001.pt", lambda p: _first_sharded(p).update(hi=_first_sharded(p)["hi"] - 1) or p),
        "rank_00001.pt",
        "elements",
    ),
    "dtype": (
        _edit_pt(
            "rank_00000.pt",
            lambda p: (
                p["groups"]["root"]["tensors"].update(master=p["groups"]["root"]["tensors"]["master"].half()) or p
            ),
        ),
        "rank_00000.pt",
        "dtype float16",
    ),
    "wrong_rank": (_edit_pt("rank_00001.pt", lambda p: p.update(rank=0) or p), "rank_00001.pt", "expected 1"),
    "python_rng": (
        _edit_pt("rank_00000.pt", lambda p: p["rng"].update(python=(3, (1, 2), None)) or p),
        "rank_00000.pt",
        "rng 'python'",
    ),
    "extra_keys": (_edit_pt("extra.pt", lambda e: e.pop("loss_scaler") and e), "extra.pt", "needs the keys"),
    "client_tensor": (
        _edit_pt("extra.pt", lambda e: e.update(client_state={"t": torch.ones(2)}) or e),
        "extra.pt",
        "client_state",
    ),
    "symlink": (_symlink, "rank_00000.pt", "symbolic links"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_or_inconsistent_file_is_refused_naming_it(v1: Path, tmp_path: Path, case: str) -> None:
    corrupt, name, check = CORRUPTIONS[case]
    corrupt(v1 / TAG)
    refused(v1, tmp_path / "new", str(v1 / TAG / name), check)


@pytest.mark.parametrize(("latest", "tag", "check"), [("../x", None, "tag in"), (TAG, "../x", "path separator")])
def test_hostile_tag_or_latest_is_refused(v1: Path, tmp_path: Path, latest: str, tag: str | None, check: str) -> None:
    (v1 / "latest").write_text(latest)
    refused(v1, tmp_path / "new", check, tag=tag)


# --- where the converter writes ------------------------------------------------------------------------------------
def test_never_writes_into_old_dir(v1: Path, tmp_path: Path) -> None:
    for new in (v1, v1 / "converted", v1 / TAG / "x"):
        before = digest(v1)
        with pytest.raises(CheckpointError, match="inside OLD_DIR"):
            convert_v1(v1, new)
        assert digest(v1) == before


def test_new_dir_must_be_new_empty_or_ours(v1: Path, original, tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=r"not a hybridzero checkpoint directory \(it holds \['notes.txt'\]\)"):
        convert_v1(v1, foreign)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    with pytest.raises(CheckpointError, match="already a format-2 checkpoint"):
        convert_v1(original[1][0], tmp_path / "x")
    ours = Path(shutil.copytree(original[1][0], tmp_path / "ours"))  # a format-2 directory with another tag
    os.replace(ours / TAG, ours / "earlier")
    (ours / "latest").write_text("earlier")
    assert convert_v1(v1, ours) == ours / TAG
    assert list_tags(ours) == ["earlier", TAG] and (ours / "latest").read_text() == TAG
    with pytest.raises(CheckpointError, match=f"already holds tag '{TAG}'"):
        convert_v1(v1, ours)
    empty = tmp_path / "empty"
    empty.mkdir()
    (v1 / "latest").unlink()
    with pytest.raises(CheckpointError, match="no 'latest' file"):
        convert_v1(v1, empty)
    assert convert_v1(v1, empty, tag=TAG) == empty / TAG and verify_tag(empty) == empty / TAG
