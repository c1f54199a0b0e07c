"""Hostile checkpoints, saves and model directories, table-driven (issue 28).

Loads: a forger edits a value and re-signs the manifest; every case must end in ``CheckpointError`` on both ranks
naming the offending file/key, with the engine bitwise unchanged (masters, compute shards, optimizer state and
hyperparameters, scheduler, RNG, loss scaler, counters) and the directory byte-for-byte unchanged. All load cases
run on one trained engine per world-2 spawn (a refused load changes nothing), which then still trains and loads a
good checkpoint. Saves: ranks disagreeing on their arguments raise on every rank before anything is written.
Model directories, ``export`` arguments and format-1 conversion: ``test_hostile_model_dirs.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness.parity import RunSpec
from tests.hostile.forge import (
    TAG,
    Forge,
    copy_tree,
    digest,
    duplicate_key_header,
    json_edit,
    rank_edit,
    raw_rank_bytes,
    resign,
    safetensors_bytes,
    state_edit,
)
from tests.workers.ckpt_trust import save_tag
from tests.workers.hostile_ckpt import load_cases, save_cases

SPEC = RunSpec(model="opt", steps=3, optimizer="client", scheduler=True)


def _opt(group: int, key: str, value: Any) -> Forge:
    def edit(s: dict[str, Any]) -> None:
        s["optimizer"]["param_groups"][group][key] = value

    return state_edit(edit)


def _step(edit_entry: Any) -> Forge:
    def edit(s: dict[str, Any]) -> None:
        s["optimizer"]["state"]["0"]["step"] = edit_entry(s["optimizer"]["state"]["0"]["step"])

    return state_edit(edit)


def _part(part: str, key: str, value: Any) -> Forge:
    def edit(s: dict[str, Any]) -> None:
        s[part][key] = value

    return state_edit(edit)


def _client(value: Any) -> Forge:
    def edit(s: dict[str, Any]) -> None:
        s["client_state"] = value

    return state_edit(edit)


def _meta(key: str, value: Any) -> Forge:
    return json_edit("meta.json", lambda m: {**m, key: value})


def _rng(rank: int, fn: Any) -> Forge:
    def edit(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> None:
        fn(tensors, header)

    return rank_edit(rank, edit)


def _set_rng(name: str, make: Any) -> Any:
    def fn(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> None:
        value = make(tensors.get("rng/torch"))
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value

    return fn


def _python_rng(value: Any) -> Any:
    def fn(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> None:
        header["python_rng"] = value

    return fn


def _symlink(name: str, outside: str) -> Forge:
    """Replace ``name`` (relative to the save directory) by a link to a copy outside the save directory."""

    def forge(root: Path) -> None:
        src = root / name
        target = root.parent / f"{root.name}-{outside}"
        if src.is_dir():
            copy_tree(src, target)
            for p in src.iterdir():
                p.unlink()
            src.rmdir()
        else:
            target.write_bytes(src.read_bytes())
            src.unlink()
        src.symlink_to(target)

    return forge


def _manifest(edit: Any) -> Forge:
    def forge(root: Path) -> None:
        file = root / TAG / "manifest.json"
        file.write_text(json.dumps(edit(json.loads(file.read_text()))))

    return forge


def _add_file(name: str) -> Any:
    def edit(m: dict[str, Any]) -> dict[str, Any]:
        m["files"][name] = "0" * 64
        return m

    return edit


def _write(name: str, data: bytes) -> Forge:
    def forge(root: Path) -> None:
        (root / name).write_bytes(data)

    return forge


def _latest_dir(root: Path) -> None:
    (root / "latest").unlink()
    (root / "latest").mkdir()


def _deep(n: int) -> Any:
    out: Any = []
    for _ in range(n):
        out = [out]
    return out


def _deep_client(root: Path) -> None:
    file = root / TAG / "state.json"
    text = file.read_text()
    file.write_text(text.replace('"client_state": {}', '"client_state": ' + "[" * 5000 + "]" * 5000))
    resign(root / TAG)


def _master_as_int(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> None:
    name = next(k for k in tensors if k.endswith("/master"))
    tensors[name] = tensors[name].to(torch.int32)


RANK1 = "rank_00001.safetensors"
RANK0 = "rank_00000.safetensors"
# name -> (forge, substrings every rank's error must contain, tag to load)
LOAD_CASES: dict[str, tuple[Forge, tuple[str, ...], str | None]] = {
    # a rank's RNG state (rank 1 only: rank 0 must refuse too, unchanged)
    "rng_dtype": (_rng(1, _set_rng("rng/torch", lambda t: t.float())), (RANK1, "rng/torch", "uint8"), None),
    "rng_2d": (_rng(1, _set_rng("rng/torch", lambda t: t.reshape(2, -1))), (RANK1, "rng/torch", "1-D"), None),
    "rng_short": (_rng(1, _set_rng("rng/torch", lambda t: t[:100].clone())), (RANK1, "rng/torch", "rejected"), None),
    "rng_missing": (_rng(1, _set_rng("rng/torch", lambda t: None)), (RANK1, "RNG state missing"), None),
    "rng_stray_cuda": (_rng(0, _set_rng("rng/cuda/3", lambda t: t.clone())), (RANK0, "rng/cuda/3"), None),
    "rng_unknown_name": (_rng(0, _set_rng("rng/evil", lambda t: t.clone())), (RANK0, "rng/evil"), None),
    "python_rng_str": (_rng(1, _python_rng("abc")), (RANK1, "python RNG"), None),
    "python_rng_short": (_rng(1, _python_rng({"$tuple": [3, {"$tuple": [1, 2]}, None]})), (RANK1, "python RNG"), None),
    "python_rng_huge_word": (
        _rng(1, _python_rng({"$tuple": [3, {"$tuple": [2**40] * 625}, None]})),
        (RANK1, "python RNG"),
        None,
    ),
    "rank_header_not_json": (_rng(1, lambda t, h: h.update({"$bad": 1})), (RANK1, "header"), None),
    # scheduler
    "sched_iteration_str": (_part("scheduler", "last_batch_iteration", "3"), ("last_batch_iteration", "'3'"), None),
    "sched_epoch_list": (_part("scheduler", "last_epoch", [1]), ("last_epoch", "integer"), None),
    "sched_epoch_bool": (_part("scheduler", "last_epoch", True), ("last_epoch", "integer"), None),
    "sched_epoch_huge": (_part("scheduler", "last_epoch", 10**30), ("last_epoch", "2**63"), None),
    "sched_iteration_negative": (_part("scheduler", "last_batch_iteration", -5), ("last_batch_iteration", "-5"), None),
    "sched_step_count_float": (_part("scheduler", "_step_count", 2.5), ("_step_count", "2.5"), None),
    "sched_lr_nan": (_part("scheduler", "_last_lr", [math.nan, 0.0]), ("_last_lr", "nan"), None),
    "sched_lr_length": (_part("scheduler", "_last_lr", [0.0]), ("_last_lr", "2 values"), None),
    "sched_missing": (_part("scheduler", "_last_lr", None), ("_last_lr",), None),
    # optimizer hyperparameters
    "lr_str": (_opt(0, "lr", "0.1"), ("param group 0 'lr'", "'0.1'"), None),
    "lr_negative": (_opt(1, "lr", -0.5), ("param group 1 'lr'", "-0.5"), None),
    "lr_inf": (_opt(0, "lr", math.inf), ("'lr'", "inf"), None),
    "betas_length": (_opt(0, "betas", {"$tuple": [0.9]}), ("'betas'", "2 values"), None),
    "betas_range": (_opt(0, "betas", {"$tuple": [0.9, 1.5]}), ("'betas'", "1.5"), None),
    "betas_str": (_opt(0, "betas", "0.9,0.95"), ("'betas'",), None),
    "eps_negative": (_opt(0, "eps", -1e-8), ("'eps'", "-1e-08"), None),
    "weight_decay_list": (_opt(0, "weight_decay", [0.1]), ("'weight_decay'",), None),
    "amsgrad_flipped": (_opt(0, "amsgrad", True), ("'amsgrad'", "True"), None),
    "fused_flag_str": (_opt(0, "fused", "yes"), ("'fused'", "'yes'"), None),
    "extra_key_object": (_opt(0, "evil", {"a": 1}), ("'evil'",), None),
    "param_groups_not_objects": (
        state_edit(lambda s: s["optimizer"].update(param_groups=[1, 2])),
        ("param groups saved",),
        None,
    ),
    # optimizer step counts and per-group state
    "step_str": (_step(lambda e: {**e, "value": "7"}), ("'step'", "'7'"), None),
    "step_negative_number": (_step(lambda e: {**e, "value": -1}), ("'step'",), None),
    "step_nan": (_step(lambda e: {**e, "value": math.nan}), ("'step'",), None),
    "step_on_device_str": (_step(lambda e: {**e, "on_param_device": "yes"}), ("on_param_device",), None),
    "step_entry_malformed": (_step(lambda e: {"value": e["value"]}), ("'step'", "on_param_device"), None),
    "state_group_index": (
        state_edit(lambda s: s["optimizer"]["state"].update({"7": {}})),
        ("group indices", "'7'"),
        None,
    ),
    "per_element_key_dropped": (
        json_edit(
            "meta.json",
            lambda m: {
                **m,
                "ranks": [{g: {**p, "keys": {"master": "float32"}} for g, p in e.items()} for e in m["ranks"]],
            },
        ),
        ("exp_avg", "AdamW needs"),
        None,
    ),
    # loss scaler
    "scale_negative": (_part("loss_scaler", "scale", -1.0), ("scale", "-1.0"), None),
    "scale_nan": (_part("loss_scaler", "scale", math.nan), ("scale", "nan"), None),
    "scale_str": (_part("loss_scaler", "scale", "65536"), ("scale", "'65536'"), None),
    "hysteresis_zero": (_part("loss_scaler", "hysteresis_left", 0), ("hysteresis_left", "0"), None),
    "good_steps_float": (_part("loss_scaler", "good_steps", 1.5), ("good_steps", "1.5"), None),
    "scaler_step_huge": (_part("loss_scaler", "step", 10**30), ("'step'", "2**63"), None),
    "good_steps_over_step": (_part("loss_scaler", "good_steps", 5), ("good_steps",), None),
    # counters
    "global_steps_float": (_meta("global_steps", 2.0), ("meta.json", "global_steps", "2.0"), None),
    "global_steps_bool": (_meta("global_steps", True), ("meta.json", "global_steps", "True"), None),
    "micro_steps_huge": (_meta("micro_steps", 10**30), ("meta.json", "micro_steps"), None),
    "skipped_steps_negative": (_meta("skipped_steps", -3), ("meta.json", "skipped_steps", "-3"), None),
    "world_size_huge": (_meta("world_size", 10**30), ("meta.json", "world_size"), None),
    # client state
    "client_tensor": (_client({"t": {"$tensor": "/optimizer/state/0/step/value"}}), ("client_state", "Tensor"), None),
    "client_int_keys": (_client({"$items": [[1, 2]]}), ("client_state", "non-string key"), None),
    "client_deep": (_deep_client, ("state.json", "RecursionError"), None),
    "client_missing": (state_edit(lambda s: s.pop("client_state")), ("state.json", "client_state"), None),
    "client_bad_tag": (_client({"$tuple": 5}), ("state.json", "$tuple"), None),
    # files, symlinks, manifest, latest
    "symlink_tag_dir": (_symlink(TAG, "outside"), (TAG, "symbolic link", "outside the save directory"), None),
    "symlink_rank_file": (_symlink(f"{TAG}/{RANK1}", "r1"), (RANK1, "symbolic link"), None),
    "symlink_meta": (_symlink(f"{TAG}/meta.json", "meta"), ("meta.json", "symbolic link"), None),
    "symlink_manifest": (_symlink(f"{TAG}/manifest.json", "manifest"), ("manifest.json", "symbolic link"), None),
    "symlink_latest": (_symlink("latest", "latest"), ("latest", "symbolic link"), None),
    "truncated_rank_resigned": (raw_rank_bytes(0, lambda b: b[: len(b) // 2]), (RANK0, "unreadable"), None),
    "garbage_rank_resigned": (raw_rank_bytes(1, lambda b: b"\x07" * 64), (RANK1, "unreadable safetensors"), None),
    "huge_shape_header": (
        raw_rank_bytes(
            1, lambda b: safetensors_bytes({"x": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 8]}}, b"\0" * 8)
        ),
        (RANK1, "unreadable safetensors"),
        None,
    ),
    "header_length_huge": (raw_rank_bytes(1, lambda b: (2**62).to_bytes(8, "little") + b[8:]), (RANK1, "header"), None),
    "duplicate_tensor_name": (raw_rank_bytes(0, duplicate_key_header), (RANK0, "duplicate key"), None),
    "master_int32": (_rng(0, _master_as_int), (RANK0, "dtype I32"), None),
    "duplicate_json_key": (
        lambda root: ((root / TAG / "meta.json").write_text('{"format": 2, "format": 2}'), resign(root / TAG)),
        ("meta.json", "duplicate key 'format'"),
        None,
    ),
    "manifest_dotdot": (_manifest(_add_file("../x")), ("manifest.json", "'../x'"), None),
    "manifest_absolute": (_manifest(_add_file("/etc/passwd")), ("manifest.json", "/etc/passwd"), None),
    "manifest_extra_file": (_manifest(_add_file("extra.bin")), ("extra.bin", "missing"), None),
    "manifest_not_json": (_write(f"{TAG}/manifest.json", b"{nope"), ("manifest.json", "unreadable JSON"), None),
    "manifest_format_3": (_manifest(lambda m: {**m, "format": 3}), ("manifest.json", "format 3"), None),
    "meta_missing": (lambda root: (root / TAG / "meta.json").unlink(), ("meta.json", "missing"), None),
    "latest_newline": (_write("latest", b"global_step1\nother"), ("latest", "control character"), None),
    "latest_dotdot": (_write("latest", b"../x"), ("latest", "../x"), None),
    "latest_directory": (_latest_dir, ("latest", "not a regular file"), None),
    "tag_newline": (lambda root: None, ("invalid checkpoint tag", "'a\\nb'"), "a\nb"),
}


@pytest.fixture(scope="module")
def good(world, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A world-2 checkpoint of SPEC after one step (never modified: cases copy it)."""
    root = tmp_path_factory.mktemp("good")
    world(2).run(save_tag, SPEC, str(root), TAG, 1)
    return root


@pytest.fixture(scope="module")
def loads(world, good: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every load case forged into its own copy of ``good``, all tried in one world-2 spawn."""
    base = tmp_path_factory.mktemp("hostile_loads")
    names = sorted(LOAD_CASES)
    cases, before = [], {}
    for name in names:
        root = copy_tree(good, base / name)
        forge, _, tag = LOAD_CASES[name]
        forge(root)
        before[name] = digest(base)
        cases.append((str(root), tag))
    out = world(2).run(load_cases, SPEC, cases, str(good), timeout=600)
    return {
        "per_case": {n: [r["cases"][i] for r in out] for i, n in enumerate(names)},
        "unchanged_dirs": digest(base) == before[names[-1]],
        "after": out,
    }


@pytest.mark.parametrize("name", sorted(LOAD_CASES))
def test_forged_load_is_refused_on_every_rank_with_nothing_applied(loads: dict[str, Any], name: str) -> None:
    needles = LOAD_CASES[name][1]
    for rank, result in enumerate(loads["per_case"][name]):
        assert result["error"].startswith("CheckpointError: "), (rank, result["error"])
        assert all(n in result["error"] for n in needles), (rank, needles, result["error"])
        assert result["unchanged"], (rank, "engine state changed by a refused load")


def test_engine_trains_and_loads_after_every_refused_load(loads: dict[str, Any]) -> None:
    assert loads["unchanged_dirs"], "a refused load modified a checkpoint directory"
    for result in loads["after"]:
        assert result["recovered"] and result["steps"] == 2, result


# --- saves: every rank agrees on its arguments before anything is written ------------------------------------
def _args(save_dir: str, tag: str = "t", **kw: Any) -> dict[str, Any]:
    return {"save_dir": save_dir, "tag": tag, **kw}


SAVE_CASES: dict[str, tuple[Any, tuple[str, ...]]] = {
    "tag": (lambda d: [_args(d, "a"), _args(d, "b")], ("rank 0 tag 'a' vs rank 1 tag 'b'",)),
    "save_dir": (
        lambda d: [_args(d), _args(d + "-other")],
        ("rank 0 save directory", "rank 1 save directory", "-other"),
    ),
    "client_state": (
        lambda d: [_args(d, client_state={"epoch": 1}), _args(d, client_state={"epoch": 2})],
        ("rank 0 client_state '{\"epoch\": 1}' vs rank 1 client_state '{\"epoch\": 2}'",),
    ),
    "save_latest": (lambda d: [_args(d), _args(d, save_latest=False)], ("save_latest True", "save_latest False")),
    "bad_tag_on_one_rank": (lambda d: [_args(d, "ok"), _args(d, "../up")], ("rank 1", "invalid checkpoint tag")),
    "client_not_json_on_one_rank": (
        lambda d: [_args(d, client_state={"x": 1}), _args(d, client_state={"x": {1, 2}})],
        ("rank 1", "client_state['x']", "set"),
    ),
    "client_nan_vs_number": (
        lambda d: [_args(d, client_state={"x": math.nan}), _args(d, client_state={"x": 1.0})],
        ("NaN", "1.0"),
    ),
    "save_dir_is_a_file": (lambda d: [_args(d + "/file/sub"), _args(d + "/file/sub")], ("rank 0", "file")),
    "tag_is_latest": (lambda d: [_args(d, "latest"), _args(d, "latest")], ("invalid checkpoint tag 'latest'",)),
}


@pytest.fixture(scope="module")
def saves(world, good: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every save case against its own copy of ``good`` (which has a ``latest``), in one world-2 spawn."""
    base = tmp_path_factory.mktemp("hostile_saves")
    names = sorted(SAVE_CASES)
    cases, before = [], {}
    for name in names:
        root = copy_tree(good, base / name)
        (root / "file").write_text("not a directory")
        before[name] = digest(root)
        cases.append(SAVE_CASES[name][0](str(root)))
    out = world(2).run(save_cases, SPEC, cases, timeout=600)
    return {
        n: {"errors": [r[i] for r in out], "unchanged": digest(base / n) == before[n], "root": base / n}
        for i, n in enumerate(names)
    }


@pytest.mark.parametrize("name", sorted(SAVE_CASES))
def test_save_with_bad_or_differing_arguments_writes_nothing(saves: dict[str, Any], name: str) -> None:
    result = saves[name]
    for rank, error in enumerate(result["errors"]):
        assert error.startswith("CheckpointError: "), (rank, error)
        assert all(n in error for n in SAVE_CASES[name][1]), (rank, SAVE_CASES[name][1], error)
    assert result["errors"][0] == result["errors"][1], "ranks reported different errors"
    assert result["unchanged"], "a refused save changed the save directory"
    root = result["root"]
    assert not list(root.parent.glob("*.partial-*")) and (root / "latest").read_text() == TAG
    assert not (Path(str(root) + "-other")).exists()
