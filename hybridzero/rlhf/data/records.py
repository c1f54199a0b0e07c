"""RLHF records: loading prompt / preference records and DeepSpeed-Chat's phase splits.

Schemas (every value a string):

* pairwise ``prompt`` / ``chosen`` / ``rejected`` -- reward model (phase 2), SFT on ``chosen`` (phase 1);
* SFT ``prompt`` / ``response`` -- SFT (phase 1) and PPO prompts (phase 3).

Sources: a ``.json`` file holding a list of objects, a ``.jsonl`` file (one object a line), or a local
Hugging Face ``datasets`` directory (written by ``save_to_disk``; needs the optional ``datasets`` package).

Phase split (DeepSpeed-Chat's ``--data_split 2,4,4``): one seeded permutation of the records is cut into three
contiguous, disjoint portions proportional to the weights, so the three training phases never see the same record.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from hybridzero.rlhf.data.demo_task import demo_data_dir
from hybridzero.rlhf.data.dschat import dschat_rows, dschat_test_rows
from hybridzero.rlhf.data.sources import (
    read_hf_directory,
    read_hub_dataset,
    read_json_file,
    read_jsonl_lines,
)

PAIRWISE_COLUMNS: tuple[str, ...] = ("prompt", "chosen", "rejected")
SFT_COLUMNS: tuple[str, ...] = ("prompt", "response")


# ----------------------------------------------------------------------------------------------- loading


def _schema_for(columns: set[str]) -> tuple[str, ...]:
    """Guess the schema of a record: pairwise when it has a ``chosen`` or ``rejected`` column, else SFT."""
    return PAIRWISE_COLUMNS if columns & {"chosen", "rejected"} else SFT_COLUMNS


def _validate_rows(
    rows: list[Any],
    source: str,
    columns: tuple[str, ...] | None,
    keep_extra: bool = False,
    lines: list[int] | None = None,
) -> list[dict[str, str]]:
    """Check every row is an object with string values in the needed columns; keep only those columns (every
    column with ``keep_extra``: the extra ones, of any JSON type, go to reward functions). Messages name the
    record, and its line when ``lines`` (a JSONL file's line numbers) are given."""
    out: list[dict[str, str]] = []
    for index, row in enumerate(rows):
        source_here = f"{source}:{lines[index]}" if lines is not None else source
        if not isinstance(row, dict):
            raise ValueError(f"{source_here}: record {index} is {type(row).__name__}, expected an object")  # noqa: TRY004
        needed = columns if columns is not None else _schema_for(set(row))
        missing = [name for name in needed if name not in row]
        if missing:
            raise ValueError(
                f"{source_here}: record {index} is missing column(s) {missing}; needed {list(needed)}, "
                f"it has {sorted(row)}"
            )
        bad = [name for name in needed if not isinstance(row[name], str)]
        if bad:
            raise ValueError(f"{source_here}: record {index} column(s) {bad} are not strings")
        out.append(dict(row) if keep_extra else {name: row[name] for name in needed})
    return out


def load_records(
    path: str | Path, columns: Sequence[str] | None = None, split: str = "train", keep_extra: bool = False
) -> list[dict[str, str]]:
    """Load and validate records from a ``.json`` / ``.jsonl`` file, a Hugging Face dataset directory, or a Hub
    dataset name (``Dahoas/rm-static``: anything that is not an existing path, a ``.json``/``.jsonl`` name, an
    absolute or a ``./`` path; needs ``datasets`` and network access or its cache).

    ``columns`` names the needed columns (e.g. :data:`PAIRWISE_COLUMNS`); ``None`` infers the schema per record
    (pairwise when ``chosen``/``rejected`` appear, else ``prompt``/``response``). Extra columns are dropped.
    ``split`` picks the split of a ``DatasetDict`` directory or Hub dataset; ``keep_extra`` keeps every column.
    Raises ``FileNotFoundError`` for a missing path or a name the Hub cannot give (naming why), ``ImportError``
    for a directory without the ``datasets`` package, and ``ValueError`` for an unknown file
    type, malformed JSON, an empty file/split, or records missing a needed column (naming the file, the missing
    columns and the columns present).
    """
    source = Path(path)
    lines: list[int] | None = None
    if not source.exists():
        if source.suffix in (".json", ".jsonl") or source.is_absolute() or str(path).startswith("."):
            raise FileNotFoundError(f"no dataset at {source}")
        rows, label = read_hub_dataset(str(path), split), f"{path} (Hub, split {split!r})"
    elif source.is_dir():
        rows = read_hf_directory(source, split)
        label = f"{source} (split {split!r})"
    elif source.suffix == ".jsonl":
        numbered = read_jsonl_lines(source)
        rows, label, lines = [row for _, row in numbered], str(source), [n for n, _ in numbered]
    elif source.suffix == ".json":
        rows, label = read_json_file(source), str(source)
    else:
        raise ValueError(f"{source}: unsupported file type {source.suffix!r}; use .json, .jsonl or a directory")
    if not rows:
        raise ValueError(f"{label}: dataset is empty (no records)")
    return _validate_rows(rows, label, tuple(columns) if columns is not None else None, keep_extra, lines)


# ----------------------------------------------------------------------------------------------- splits


def _parse_split(split: str) -> list[Fraction]:
    """Parse ``"2,4,4"`` into three non-negative weights with a positive sum."""
    try:
        weights = [Fraction(part.strip()) for part in split.split(",")]
    except (ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"data split {split!r}: expected three comma-separated numbers") from exc
    if len(weights) != 3 or any(w < 0 for w in weights) or sum(weights) == 0:
        raise ValueError(
            f"data split {split!r}: expected three non-negative comma-separated weights with a positive sum"
        )
    return weights


def _phase_bounds(weights: list[Fraction], size: int) -> list[int]:
    """Cumulative cut points ``[0, b1, b2, size]``: each rounds the exact cumulative share half up."""
    total = sum(weights)
    bounds, running = [0], Fraction(0)
    for weight in weights:
        running += weight
        bounds.append(int(running * size / total + Fraction(1, 2)))
    return bounds


def _permutation(size: int, seed: int) -> list[int]:
    """A deterministic permutation of ``range(size)`` (independent of global random state)."""
    order = list(range(size))
    random.Random(seed).shuffle(order)
    return order


def split_for_phase(records: Sequence[Any], split: str = "2,4,4", phase: int = 1, seed: int = 1234) -> list[Any]:
    """Return the records of training ``phase`` (1 SFT, 2 reward model, 3 RL) under DeepSpeed-Chat's split.

    The records are shuffled with ``seed`` and the permutation is cut into three contiguous portions whose sizes
    are proportional to the ``split`` weights; cut points are rounded cumulatively, so every record belongs to
    exactly one phase and the same ``seed`` gives disjoint phases. Raises ``ValueError`` when the split is
    malformed, ``phase`` is not 1-3, or the phase's share is empty (naming the split string and the phase).
    """
    if phase not in (1, 2, 3):
        raise ValueError(f"phase must be 1, 2 or 3, got {phase!r}")
    weights = _parse_split(split)
    bounds = _phase_bounds(weights, len(records))
    start, stop = bounds[phase - 1], bounds[phase]
    if stop <= start:
        raise ValueError(
            f"data split {split!r} gives phase {phase} no records (of {len(records)}); "
            f"raise its weight or provide more data"
        )
    order = _permutation(len(records), seed)
    return [records[i] for i in order[start:stop]]


def train_eval_split(records: Sequence[Any], eval_fraction: float, seed: int = 1234) -> tuple[list[Any], list[Any]]:
    """Shuffle with ``seed`` and hold out ``round(eval_fraction * n)`` (at least one) records for evaluation.

    Returns ``(train, eval)``, disjoint and together covering ``records``. Raises ``ValueError`` when
    ``eval_fraction`` is not in ``(0, 1)`` or either side would be empty.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    size = len(records)
    n_eval = max(1, int(Fraction(eval_fraction) * size + Fraction(1, 2)))
    if n_eval >= size:
        raise ValueError(
            f"eval_fraction {eval_fraction} of {size} record(s) leaves no training records; need more data"
        )
    order = _permutation(size, seed)
    return [records[i] for i in order[n_eval:]], [records[i] for i in order[:n_eval]]


DEMO_FILES: dict[int, str] = {1: "sft.jsonl", 2: "pairs.jsonl", 3: "prompts.jsonl"}


def _for_phase(rows: list[dict[str, str]], phase: int, name: str) -> list[dict[str, str]]:
    """A DeepSpeed-Chat dataset's phase share in our schemas: step 2 keeps the rows that have a rejected answer;
    steps 1 and 3 keep every row (those without one as ``prompt`` / ``response``)."""
    if phase == 2:
        kept = [r for r in rows if "rejected" in r]
        if not kept:
            raise ValueError(
                f"{name}: no record of its step-2 share has a rejected answer; DeepSpeed-Chat uses "
                "this dataset for steps 1 and 3 only (give it a data_split such as 10,0,0)"
            )
        return kept
    return [r if "rejected" in r else {"prompt": r["prompt"], "response": r["chosen"]} for r in rows]


def phase_records(
    paths: Sequence[str],
    split: str,
    phase: int,
    columns: Sequence[str] | None,
    seed: int,
    data_root: str | None = None,
    keep_extra: bool = False,
) -> list[dict[str, str]]:
    """The records of training ``phase`` from every dataset in ``paths`` (in order).

    ``"demo"`` is the shipped demo dataset's file for the phase (no split: its files are per phase); a
    DeepSpeed-Chat dataset name is read from its local copy under ``data_root`` through its schema adapter
    (:mod:`hybridzero.rlhf.data.dschat`); any other path goes through :func:`load_records`. Both take DeepSpeed-Chat's
    phase split ``split`` of the whole dataset first, so the phases stay disjoint. ``keep_extra`` keeps every
    column of a file's rows (step 3's reward-function columns; a DeepSpeed-Chat dataset has none).
    """
    out: list[dict[str, str]] = []
    for path in paths:
        if path == "demo":
            out += load_records(demo_data_dir() / DEMO_FILES[phase], columns, keep_extra=keep_extra)
            continue
        rows = dschat_rows(path, data_root)
        if rows is None:
            out += split_for_phase(load_records(path, columns, keep_extra=keep_extra), split, phase, seed)
        else:
            share = _for_phase(split_for_phase(rows, split, phase, seed), phase, path)
            out += _validate_rows(share, path, tuple(columns) if columns is not None else None)
    return out


def phase_train_eval(
    paths: Sequence[str],
    split: str,
    phase: int,
    columns: Sequence[str] | None,
    seed: int,
    data_root: str | None,
    eval_fraction: float,
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """``(train, eval)`` records of ``phase`` for steps 1-2, per dataset in ``paths`` (in order).

    A DeepSpeed-Chat dataset whose copy has a ``test`` split is evaluated, as DeepSpeed-Chat does, on that split's
    share of ``phase`` (same ``split`` and ``seed``) and trained on its whole train-split share; any other dataset
    (or a test split too small to have a share for ``phase``) holds out ``eval_fraction`` of its phase share. Train
    and eval are disjoint whenever the dataset's own splits are."""
    train: list[dict[str, str]] = []
    evals: list[dict[str, str]] = []
    cols = tuple(columns) if columns is not None else None
    for path in paths:
        share = phase_records([path], split, phase, columns, seed, data_root)
        test = dschat_test_rows(path, data_root) if path != "demo" else None
        held = _phase_share(test, split, phase, seed) if test is not None else []
        if held:
            train += share
            evals += _validate_rows(_for_phase(held, phase, path), path, cols)
        else:
            kept, out = train_eval_split(share, eval_fraction, seed)
            train, evals = train + kept, evals + out
    return train, evals


def _phase_share(rows: list[dict[str, str]], split: str, phase: int, seed: int) -> list[dict[str, str]]:
    """``rows``' share of ``phase``, or ``[]`` when the split leaves it none (a small test split)."""
    bounds = _phase_bounds(_parse_split(split), len(rows))
    return split_for_phase(rows, split, phase, seed) if bounds[phase] > bounds[phase - 1] else []


def whole_records(paths: Sequence[str], data_root: str | None = None) -> list[dict[str, str]]:
    """Every record of each dataset in ``paths`` (no phase split: DeepSpeed-Chat's ``sft_only_data_path``)."""
    out: list[dict[str, str]] = []
    for path in paths:
        rows = dschat_rows(path, data_root)
        out += load_records(path) if rows is None else _validate_rows(_for_phase(rows, 1, path), path, None)
    return out
