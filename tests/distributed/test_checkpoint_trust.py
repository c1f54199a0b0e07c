"""A checkpoint is a trust boundary: hostile files never run code, hostile tags and ``latest`` contents never
leave the save directory, every corruption is refused on every rank naming the file with the engine bitwise
unchanged, and a save killed at any point leaves the previous checkpoint loadable.

One file of hostile cases: they share their fixtures and read as one checklist. Optimizer state of every shape,
the 16-bit model, DeepSpeed's load options and ``from_pretrained``'s shape checks are in ``test_checkpoint_files.py``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridzero.checkpoint import CheckpointError, list_tags, verify_tag
from hybridzero.cli import main
from tests.harness.parity import RunSpec
from tests.harness.spawn import RemoteError
from tests.workers.ckpt import edit_json
from tests.workers.ckpt_trust import (
    failing_load,
    hostile_save,
    killed_save,
    load_params,
    payload_bytes,
    save_tag,
)

SPEC = RunSpec(model="opt", steps=3, optimizer="client", scheduler=True)
TAG = "global_step1"


def quick_first(values: list[Any]) -> list[Any]:
    """Parameters for a family of cases: the first in the quick subset, the rest marked slow (CI runs all)."""
    return [v if i == 0 else pytest.param(v, marks=pytest.mark.slow) for i, v in enumerate(values)]


def digest(root: Path) -> str:
    """Hash of every path and file content under ``root``."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def good(world, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A world-2 checkpoint of SPEC after one step (never modified: tests copy it)."""
    root = tmp_path_factory.mktemp("good")
    world(2).run(save_tag, SPEC, str(root), TAG, 1)
    return root


@pytest.fixture()
def ckpt(good: Path, tmp_path: Path) -> Path:
    """A private copy of ``good``."""
    out = tmp_path / "ckpt"
    out.mkdir()
    for src in good.rglob("*"):
        dst = out / src.relative_to(good)
        if src.is_dir():
            dst.mkdir()
        else:
            dst.write_bytes(src.read_bytes())
    return out


def refused(world, ckpt: Path, good: Path, *needles: str, tag: str | None = None) -> list[dict[str, Any]]:
    """Load ``ckpt`` at world 2 expecting failure: every rank raises naming ``needles``, is bitwise unchanged and
    still trains and loads ``good``."""
    out = world(2).run(failing_load, SPEC, str(ckpt), tag, None, str(good), timeout=240)
    for r in out:
        assert r["error"].startswith("CheckpointError"), r["error"]
        assert all(n in r["error"] for n in needles), (needles, r["error"])
        assert r["unchanged"] and r["recovered"], r
    return out


# --- crafted pickles never execute ---------------------------------------------------------------------------
PICKLE_TARGETS = [
    "rank_00000.safetensors",
    "rank_00001.safetensors",
    "meta.json",
    "state.json",
    "state.safetensors",
    "manifest.json",
]


@pytest.mark.parametrize("target", quick_first(PICKLE_TARGETS))
def test_pickle_in_checkpoint_never_runs_on_load(world, ckpt: Path, good: Path, tmp_path: Path, target: str) -> None:
    marker = tmp_path / "pwned"
    (ckpt / TAG / target).write_bytes(payload_bytes(str(marker)))
    refused(world, ckpt, good, target)
    assert not marker.exists()


@pytest.mark.parametrize("target", quick_first(PICKLE_TARGETS))
def test_pickle_in_checkpoint_never_runs_on_export(
    ckpt: Path, tmp_path: Path, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "pwned"
    (ckpt / TAG / target).write_bytes(payload_bytes(str(marker)))
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 1
    assert target in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_old_pickle_format_is_refused_without_unpickling(
    world, good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "pwned"
    old = tmp_path / "old"
    (old / TAG).mkdir(parents=True)
    (old / "latest").write_text(TAG)
    (old / TAG / "meta.json").write_text(json.dumps({"format": 1, "world_size": 1}))
    for name in ("rank_00000.pt", "extra.pt"):
        (old / TAG / name).write_bytes(payload_bytes(str(marker)))
    refused(world, old, good, "old pickle-based format 1")
    assert main(["export", str(old), str(tmp_path / "out")]) == 1
    assert "format 1" in capsys.readouterr().err
    assert not marker.exists()


# --- hostile tags and latest -----------------------------------------------------------------------------------
HOSTILE_TAGS = [
    "../escaped",
    "/tmp/abs-tag",
    "a/b",
    ".",
    "..",
    "x.partial-1",
    "bell\x07",
    "new\nline",
    "",
    "latest",
    "back\\slash",
]


@pytest.mark.parametrize("tag", quick_first(HOSTILE_TAGS))
def test_hostile_tag_refused_on_save(world, tmp_path: Path, tag: str) -> None:
    root = tmp_path / "save"
    (tmp_path / "escaped").mkdir()
    (tmp_path / "escaped" / "precious.txt").write_text("keep me")
    before = digest(tmp_path)
    out = world(2).run(hostile_save, SPEC, str(root), tag)
    assert all(t.startswith("CheckpointError") and "invalid checkpoint tag" in t for t in out), out
    assert digest(tmp_path) == before
    assert not Path("/tmp/abs-tag").exists()


@pytest.mark.parametrize("tag", quick_first(HOSTILE_TAGS))
def test_hostile_tag_refused_on_load(world, ckpt: Path, good: Path, tag: str) -> None:
    before = digest(ckpt.parent)
    refused(world, ckpt, good, "invalid checkpoint tag", tag=tag)
    assert digest(ckpt.parent) == before


@pytest.mark.parametrize(
    "content",
    quick_first(
        [b"../ckpt/global_step1", b"/etc", b"a/b", b"..", b"", b"\xff\xfe", b"global_step1.partial-x", b"x" * 5000]
    ),
)
def test_hostile_latest_refused(world, ckpt: Path, good: Path, content: bytes) -> None:
    (ckpt / "latest").write_bytes(content)
    before = digest(ckpt.parent)
    refused(world, ckpt, good, "latest")
    assert digest(ckpt.parent) == before


def test_existing_directory_that_is_not_ours_is_never_replaced(world, ckpt: Path) -> None:
    (ckpt / "mine").mkdir()
    (ckpt / "mine" / "thesis.tex").write_text("years of work")
    before = digest(ckpt)
    out = world(2).run(hostile_save, SPEC, str(ckpt), "mine")
    assert all("is not a hybridzero checkpoint" in t for t in out), out
    assert digest(ckpt) == before
    # our own tag is replaced atomically and stays loadable
    assert world(2).run(hostile_save, SPEC, str(ckpt), TAG) == ["saved", "saved"]
    assert list_tags(ckpt) == [TAG] and verify_tag(ckpt) == ckpt / TAG


def test_client_state_must_be_json(world, tmp_path: Path) -> None:
    out = world(2).run(hostile_save, SPEC, str(tmp_path / "c"), "t", {"ok": [1, 2], "bad": torch.ones(2)})
    assert all("client_state['bad']" in t and "Tensor" in t for t in out), out
    assert not (tmp_path / "c" / "t").exists()


# --- corruption: every rank raises naming the file; nothing changes ------------------------------------------
def _flip(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at % len(data)] ^= 0x01
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "target", quick_first(["rank_00001.safetensors", "meta.json", "state.json", "state.safetensors"])
)
def test_flipped_byte(world, ckpt: Path, good: Path, target: str) -> None:
    _flip(ckpt / TAG / target, -20)
    refused(world, ckpt, good, target, "checksum mismatch")


def test_truncated_rank_file(world, ckpt: Path, good: Path) -> None:
    f = ckpt / TAG / "rank_00000.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    refused(world, ckpt, good, "rank_00000.safetensors", "checksum mismatch")


@pytest.mark.parametrize("target", ["rank_00001.safetensors", "state.json", "manifest.json"])
def test_missing_file(world, ckpt: Path, good: Path, target: str) -> None:
    (ckpt / TAG / target).unlink()
    refused(world, ckpt, good, target, "missing")


def _first_param(meta: dict[str, Any]) -> str:
    return next(n for n, i in meta["params"].items() if len(i["shape"]) == 2)


def _set_param(key: str, fn: Any) -> Any:
    def edit(meta: dict[str, Any]) -> dict[str, Any]:
        info = meta["params"][_first_param(meta)]
        info[key] = fn(info)
        return meta

    return edit


def _rank1(fn: Any) -> Any:
    def edit(meta: dict[str, Any]) -> dict[str, Any]:
        part = next(p for p in meta["ranks"][1].values() if p["hi"] > p["lo"] + 32)
        fn(part)
        return meta

    return edit


METADATA_DAMAGE = {
    "world_size_0": (lambda m: {**m, "world_size": 0}, "world_size must be an integer > 0"),
    "world_size_str": (lambda m: {**m, "world_size": "2"}, "world_size must be an integer > 0"),
    "offset_out_of_group": (_set_param("offset", lambda i: 10**9), "exceeds group"),
    "offset_overlap": (_set_param("offset", lambda i: i["offset"] + 16), "overlap"),
    "numel": (_set_param("numel", lambda i: i["numel"] + 1), "numel"),
    "shape_vs_model": (_set_param("shape", lambda i: i["shape"][::-1]), "shape"),
    "dtype": (_rank1(lambda p: p["keys"].update(master="float16")), "'master' float32"),
    "state_dtype": (_rank1(lambda p: p["keys"].update(exp_avg="bfloat16")), "dtype F32"),
    "shard_gap": (_rank1(lambda p: p.update(lo=p["lo"] + 16)), "gap"),
    "shard_overlap": (_rank1(lambda p: p.update(lo=p["lo"] - 16)), "overlap"),
    "range_outside": (_rank1(lambda p: p.update(hi=10**9)), "outside"),
    "negative_steps": (lambda m: {**m, "global_steps": -1}, "global_steps"),
}


@pytest.mark.parametrize("case", quick_first(sorted(METADATA_DAMAGE)))
def test_inconsistent_metadata(world, ckpt: Path, good: Path, case: str) -> None:
    """The manifest is re-signed: only the consistency checks stand between this file and the engine."""
    edit, needle = METADATA_DAMAGE[case]
    edit_json(ckpt / TAG, "meta.json", edit)
    refused(world, ckpt, good, "meta.json", needle)


STATE_DAMAGE = {
    "param_groups": (
        lambda s: {**s, "optimizer": {**s["optimizer"], "param_groups": s["optimizer"]["param_groups"][:1]}},
        "param groups saved",
    ),
    "optimizer_class": (lambda s: {**s, "optimizer": {**s["optimizer"], "class": "SGD"}}, "saved by SGD"),
    "scheduler": (lambda s: {**s, "scheduler": {"last_epoch": 1}}, "scheduler state has keys"),
    "loss_scaler": (lambda s: {**s, "loss_scaler": {"scale": 1.0}}, "loss scaler state has keys"),
    "bad_tag": (lambda s: {**s, "client_state": {"$tensor": "nope"}}, "malformed tagged value"),
}


@pytest.mark.parametrize("case", quick_first(sorted(STATE_DAMAGE)))
def test_inconsistent_state(world, ckpt: Path, good: Path, case: str) -> None:
    edit, needle = STATE_DAMAGE[case]
    edit_json(ckpt / TAG, "state.json", edit)
    refused(world, ckpt, good, "state.json", needle)


def test_failure_on_one_rank_only_raises_on_every_rank(world, ckpt: Path, good: Path) -> None:
    """Rank 0 reads an intact checkpoint, rank 1 a damaged copy: both raise, rank 0's engine is unchanged too."""
    _flip(ckpt / TAG / "rank_00000.safetensors", -5)
    out = world(2).run(failing_load, SPEC, None, None, [str(good), str(ckpt)], str(good), timeout=240)
    for r in out:
        assert "rank 1: " in r["error"] and "rank_00000.safetensors" in r["error"] and "checksum" in r["error"]
        assert r["unchanged"] and r["recovered"]


def test_verify_tag(ckpt: Path) -> None:
    assert verify_tag(ckpt) == ckpt / TAG == verify_tag(ckpt, TAG)
    with pytest.raises(CheckpointError, match="no checkpoint 'nope'"):
        verify_tag(ckpt, "nope")
    _flip(ckpt / TAG / "state.safetensors", 3)
    with pytest.raises(CheckpointError, match="state.safetensors.*checksum"):
        verify_tag(ckpt)


# --- a killed save leaves the previous checkpoint loadable ----------------------------------------------------
@pytest.mark.parametrize("point", quick_first(["publish", "rank_file", "latest", "resave_aside", "resave_publish"]))
def test_killed_save_leaves_a_loadable_checkpoint(world, tmp_path: Path, point: str) -> None:
    pool = world(2, env={"HYBRIDZERO_TEST": f"kill-{point}"})
    with pytest.raises(RemoteError):
        pool.run(killed_save, SPEC, str(tmp_path), point, timeout=120)
    pool.close()
    assert (tmp_path / "latest").read_text() == "tag1"
    out = world(2).run(load_params, SPEC, str(tmp_path))
    assert out[0]["path"] is not None and Path(out[0]["path"]).name.startswith("tag1")
    if point == "latest":  # tag2 was published complete before the kill; latest still names tag1
        assert list_tags(tmp_path) == ["tag1", "tag2"] and verify_tag(tmp_path, "tag2")


@pytest.mark.parametrize("tag", ["../good", "/etc", "x.partial-1"])
def test_export_refuses_hostile_tags(ckpt: Path, tmp_path: Path, tag: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = digest(tmp_path)
    assert main(["export", str(ckpt), str(tmp_path / "out"), "--tag", tag]) == 1
    assert "invalid checkpoint tag" in capsys.readouterr().err
    assert digest(tmp_path) == before


def test_export_refuses_inconsistent_metadata(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``world_size: 0`` once loaded as an all-zero model and exported with status 0."""
    edit_json(ckpt / TAG, "meta.json", lambda m: {**m, "world_size": 0})
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 1
    assert "meta.json" in capsys.readouterr().err and not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="world_size must be an integer > 0"):
        verify_tag(ckpt)
