"""DeepSpeed-Chat's datasets by name, read from a local saved copy, each through its own schema adapter.

Every name DeepSpeed-Chat's ``raw_datasets.py`` knows maps to a pure function ``row -> (prompt, chosen, rejected)``
that extracts the strings as its class does (``" Human: " + question + " Assistant:"`` prompts, ``" " + answer``
responses, webgpt's citation brackets removed, SHP's label picking the chosen answer, ...); ``rejected`` is ``None``
for the datasets that have only one answer (those serve steps 1 and 3 only, as in DeepSpeed-Chat).

Where the copy lives: a ``--data_path`` entry that names a DeepSpeed-Chat dataset (``Dahoas/rm-static``) is read
from ``DATA_ROOT/Dahoas/rm-static`` (``DATA_ROOT`` = ``--data_root``, else ``$HYBRIDZERO_DATA_ROOT``); a path that
ends with such a name (``/data/Dahoas/rm-static``) is read from that path with the name's adapter. A copy is a
directory written by ``datasets``' ``save_to_disk`` (a ``DatasetDict`` or one split), or a folder holding
``train.jsonl`` / ``train.json``; its ``train`` split is used for training and, where the copy has one, its
``test`` split (``test.jsonl`` / ``test.json``, or DeepSpeed-Chat's ``eval.json``) for evaluation
(:func:`dschat_test_rows`). ``mkqa-Chinese`` and ``mkqa-Japanese`` both read the
``mkqa`` copy; ``local/jsonfile`` reads ``DATA_ROOT/data/train.json`` (DeepSpeed-Chat's ``data/train.json`` beside
its scripts). Without a local copy the name goes to ``datasets.load_dataset`` (its cache, or the network), and the
error names where the copy was looked for.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridzero.rlhf.data.sources import (
    read_hf_directory,
    read_hf_split,
    read_hub_dataset,
    read_json_file,
    read_jsonl_file,
)

__all__ = ["DSCHAT_DATASETS", "DsChatDataset", "dschat_rows", "dschat_test_rows", "find_dschat_dataset", "local_copy"]

Triple = tuple[str | None, str | None, str | None]
DATA_ROOT_ENV = "HYBRIDZERO_DATA_ROOT"


def _human(question: str | None) -> str | None:
    return None if question is None else " Human: " + question + " Assistant:"


def _space(text: str | None) -> str | None:
    return None if text is None else " " + text


def _first_text(items: Any) -> str | None:
    """``items[0]["text"]`` when present (miracl passages, mkqa answers)."""
    return items[0].get("text") if items else None


def _plain(row: dict[str, Any]) -> Triple:
    return row.get("prompt"), row.get("chosen"), row.get("rejected")


def _gptj(row: dict[str, Any]) -> Triple:
    return _human(row["prompt"]), _space(row["chosen"]), _space(row["rejected"])


def _yitingxie(row: dict[str, Any]) -> Triple:
    return row["prompt"] + "Assistant:", row["chosen"].split("Assistant:")[-1], row["rejected"].split("Assistant:")[-1]


def _uncite(text: str) -> str:
    """webgpt answers without their ``[1]`` / ``(2)`` citations (DeepSpeed-Chat's two substitutions)."""
    return re.sub(r"[\(\[].*?[\)\]]", "", re.sub(r" [\(\[].*?[\)\]]", "", text))


def _webgpt(row: dict[str, Any]) -> Triple:
    first_wins = float(row["score_0"]) >= float(row["score_1"])
    good, bad = (row["answer_0"], row["answer_1"]) if first_wins else (row["answer_1"], row["answer_0"])
    return _human(row["question"]["full_text"]), " " + _uncite(good), " " + _uncite(bad)


def _shp(row: dict[str, Any]) -> Triple:
    a_wins = int(row["labels"]) == 1
    good, bad = (row["human_ref_A"], row["human_ref_B"]) if a_wins else (row["human_ref_B"], row["human_ref_A"])
    return _human(row["history"]), " " + good, " " + bad


def _sharegpt(row: dict[str, Any]) -> Triple:
    prompt, label = row.get("prompt"), row.get("label")
    prompt = prompt.replace("USER", "Human").replace("ASSISTANT", "Assistant") if prompt else None
    return prompt, (" " + label if label else None), None


def _local_json(row: dict[str, Any]) -> Triple:
    return _space(row.get("prompt")), _space(row.get("chosen")), _space(row.get("rejected"))


def _zhihu(row: dict[str, Any]) -> Triple:
    return _human(row.get("INSTRUCTION")), _space(row.get("RESPONSE")), None


def _miracl(row: dict[str, Any]) -> Triple:
    return (
        _human(row["query"]),
        _space(_first_text(row["positive_passages"])),
        _space(_first_text(row["negative_passages"])),
    )


def _hc3(row: dict[str, Any]) -> Triple:
    answers = row.get("human_answers") or [None]
    return _human(row.get("question")), _space(answers[0]), None


def _mkqa(lang: str) -> Callable[[dict[str, Any]], Triple]:
    def extract(row: dict[str, Any]) -> Triple:
        return _human(row["queries"].get(lang)), _space(_first_text(row["answers"].get(lang))), None

    return extract


def _qg_jaquad(row: dict[str, Any]) -> Triple:
    return _human(row["question"]), _space(row["sentence"]), None


def _qag_jaquad(row: dict[str, Any]) -> Triple:
    return _human(row["questions"][0]), _space(row["paragraph"]), None


@dataclass(frozen=True)
class DsChatDataset:
    """One DeepSpeed-Chat dataset: its name, the folder its copy lives in (relative to DATA_ROOT) and its adapter."""

    name: str
    folder: str
    extract: Callable[[dict[str, Any]], Triple]


DSCHAT_DATASETS: dict[str, DsChatDataset] = {
    d.name: d
    for d in (
        DsChatDataset("Dahoas/rm-static", "Dahoas/rm-static", _plain),
        DsChatDataset("Dahoas/full-hh-rlhf", "Dahoas/full-hh-rlhf", _plain),
        DsChatDataset("Dahoas/synthetic-instruct-gptj-pairwise", "Dahoas/synthetic-instruct-gptj-pairwise", _gptj),
        DsChatDataset("yitingxie/rlhf-reward-datasets", "yitingxie/rlhf-reward-datasets", _yitingxie),
        DsChatDataset("openai/webgpt_comparisons", "openai/webgpt_comparisons", _webgpt),
        DsChatDataset("stanfordnlp/SHP", "stanfordnlp/SHP", _shp),
        DsChatDataset("pvduy/sharegpt_alpaca_oa_vicuna_format", "pvduy/sharegpt_alpaca_oa_vicuna_format", _sharegpt),
        DsChatDataset("local/jsonfile", "data", _local_json),
        DsChatDataset("wangrui6/Zhihu-KOL", "wangrui6/Zhihu-KOL", _zhihu),
        DsChatDataset("Cohere/miracl-zh-queries-22-12", "Cohere/miracl-zh-queries-22-12", _miracl),
        DsChatDataset("Hello-SimpleAI/HC3-Chinese", "Hello-SimpleAI/HC3-Chinese", _hc3),
        DsChatDataset("mkqa-Chinese", "mkqa", _mkqa("zh_cn")),
        DsChatDataset("mkqa-Japanese", "mkqa", _mkqa("ja")),
        DsChatDataset("Cohere/miracl-ja-queries-22-12", "Cohere/miracl-ja-queries-22-12", _miracl),
        DsChatDataset("lmqg/qg_jaquad", "lmqg/qg_jaquad", _qg_jaquad),
        DsChatDataset("lmqg/qag_jaquad", "lmqg/qag_jaquad", _qag_jaquad),
    )
}


def find_dschat_dataset(path: str) -> DsChatDataset | None:
    """The DeepSpeed-Chat dataset ``path`` names (exactly, or as its last components), else ``None``."""
    clean = path.rstrip("/")
    for name, spec in DSCHAT_DATASETS.items():
        if clean == name or clean.endswith("/" + name):
            return spec
    return None


def _data_root(data_root: str | None) -> Path | None:
    root = data_root or os.environ.get(DATA_ROOT_ENV)
    return Path(root) if root else None


def local_copy(path: str, spec: DsChatDataset, data_root: str | None) -> Path | None:
    """Where the copy of ``spec`` is: ``path`` itself when it exists, else ``DATA_ROOT/folder``, else ``None``."""
    given = Path(path)
    if given.exists():
        return given
    root = _data_root(data_root)
    if root is None:
        return None
    copy = root / spec.folder  # folder is one of the constant names above: never escapes the root
    return copy if copy.exists() else None


def _read_copy(copy: Path, spec: DsChatDataset) -> list[Any]:
    """The ``train`` rows of a local copy (``save_to_disk`` directory or ``train.jsonl`` / ``train.json``)."""
    if spec.name == "local/jsonfile" or (copy / "train.json").is_file() or (copy / "train.jsonl").is_file():
        if (copy / "train.jsonl").is_file():
            return read_jsonl_file(copy / "train.jsonl")
        if not (copy / "train.json").is_file():
            raise FileNotFoundError(f"{spec.name}: no train.json or train.jsonl in {copy}")
        try:
            return read_json_file(copy / "train.json")
        except ValueError:  # datasets' "json" loader also reads JSON lines under a .json name
            return read_jsonl_file(copy / "train.json")
    return read_hf_directory(copy, "train")


def dschat_rows(path: str, data_root: str | None) -> list[dict[str, str]] | None:
    """Records ``{"prompt", "chosen"[, "rejected"]}`` of the DeepSpeed-Chat dataset ``path`` names (rows whose
    prompt or chosen answer is missing are skipped, as DeepSpeed-Chat does), or ``None`` when it names none."""
    spec = find_dschat_dataset(path)
    if spec is None:
        return None
    copy = local_copy(path, spec, data_root)
    if copy is not None:
        raw = _read_copy(copy, spec)
    else:
        root = _data_root(data_root)
        where = f"{root / spec.folder}" if root else f"--data_root DIR (or ${DATA_ROOT_ENV}) as DIR/{spec.folder}"
        try:
            raw = read_hub_dataset(spec.folder if spec.folder == "mkqa" else spec.name, "train")
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{spec.name}: no local copy (looked for {where}); {exc}") from None
    return _extract(spec, raw)


def _read_test(copy: Path) -> list[Any] | None:
    """The evaluation split of a local copy, or ``None`` when it has none."""
    for name in ("test.jsonl", "eval.jsonl"):
        if (copy / name).is_file():
            return read_jsonl_file(copy / name)
    for name in ("test.json", "eval.json"):
        if (copy / name).is_file():
            try:
                return read_json_file(copy / name)
            except ValueError:
                return read_jsonl_file(copy / name)
    if (copy / "train.json").is_file() or (copy / "train.jsonl").is_file() or not copy.is_dir():
        return None
    return read_hf_split(copy, "test")


def dschat_test_rows(path: str, data_root: str | None) -> list[dict[str, str]] | None:
    """Records of the ``test`` split of the DeepSpeed-Chat dataset ``path`` names (DeepSpeed-Chat evaluates on it),
    or ``None`` when its copy has no test split (or ``path`` names no such dataset)."""
    spec = find_dschat_dataset(path)
    if spec is None:
        return None
    copy = local_copy(path, spec, data_root)
    if copy is not None:
        raw = _read_test(copy)
    else:
        try:
            raw = read_hub_dataset(spec.folder if spec.folder == "mkqa" else spec.name, "test")
        except FileNotFoundError:
            return None
    return None if not raw else _extract(spec, raw)


def _extract(spec: DsChatDataset, raw: list[Any]) -> list[dict[str, str]]:
    """``spec``'s adapter over ``raw`` rows (rows without a prompt or chosen answer skipped)."""
    out: list[dict[str, str]] = []
    for index, row in enumerate(raw):
        try:
            prompt, chosen, rejected = spec.extract(row)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(
                f"{spec.name}: record {index} does not have {spec.name}'s schema "
                f"({type(exc).__name__}: {exc}); it has {sorted(row) if isinstance(row, dict) else row}"
            ) from exc
        if prompt is None or chosen is None:
            continue
        out.append({"prompt": prompt, "chosen": chosen} | ({"rejected": rejected} if rejected is not None else {}))
    if not out:
        raise ValueError(f"{spec.name}: no usable records (every row lacks a prompt or a chosen answer)")
    return out
