"""Tests of hybridzero.rlhf.data: loading, DeepSpeed-Chat phase splits, tokenization helpers and their errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hybridzero.rlhf.data import (
    IGNORE_INDEX,
    PAIRWISE_COLUMNS,
    SFT_COLUMNS,
    check_budget,
    load_records,
    pad_sequences,
    pad_token_id,
    pairwise_example,
    prompt_batch,
    sft_example,
    split_for_phase,
    train_eval_split,
)

WORDS: tuple[str, ...] = ("q1", "q2", "q3", "q4", "q5", "q6", "a1", "a2", "a3", "b1", "b2")


def make_tok(pad: bool = True) -> PreTrainedTokenizerFast:
    """A tiny word-level tokenizer: one id per word of WORDS, plus [UNK]=0, [PAD]=1, [EOS]=2."""
    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "[EOS]", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    extra: dict[str, str] = {"pad_token": "[PAD]"} if pad else {}
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="[EOS]", **extra)


def ids(text: str) -> list[int]:
    """Expected ids of whitespace-separated WORDS."""
    return [3 + WORDS.index(w) for w in text.split()]


EOS = 2


def pairs() -> list[dict[str, str]]:
    """Five fresh pairwise records."""
    return [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(5)]


def write_json(path: Path, data: Any) -> Path:
    """Write ``data`` as JSON to ``path``."""
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


# ------------------------------------------------------------------ loading


def test_load_json_and_jsonl(tmp_path: Path) -> None:
    rows = [dict(r, extra="x") for r in pairs()]
    assert load_records(write_json(tmp_path / "d.json", rows)) == pairs()
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert load_records(jsonl, columns=PAIRWISE_COLUMNS) == pairs()


def test_load_sft_schema_and_explicit_columns(tmp_path: Path) -> None:
    rows = [{"prompt": "a", "response": "b"}]
    path = write_json(tmp_path / "s.json", rows)
    assert load_records(path) == rows
    assert load_records(path, columns=SFT_COLUMNS) == rows
    assert load_records(write_json(tmp_path / "p.json", pairs()), columns=("prompt",)) == [
        {"prompt": r["prompt"]} for r in pairs()
    ]


def test_load_missing_columns_names_file_missing_and_present(tmp_path: Path) -> None:
    path = write_json(tmp_path / "bad.json", [{"prompt": "p", "chosen": "c", "score": 1}])
    with pytest.raises(ValueError) as err:
        load_records(path)
    msg = str(err.value)
    assert "bad.json" in msg and "['rejected']" in msg and "['chosen', 'prompt', 'score']" in msg
    with pytest.raises(ValueError, match=r"missing column\(s\) \['response'\]"):
        load_records(write_json(tmp_path / "s.json", [{"prompt": "p"}]), columns=SFT_COLUMNS)


def test_load_empty_and_malformed(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"empty\.json: dataset is empty"):
        load_records(write_json(tmp_path / "empty.json", []))
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"blank\.jsonl: dataset is empty"):
        load_records(blank)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "response": "b"}\n{oops\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: invalid JSON line"):
        load_records(broken)
    with pytest.raises(ValueError, match="expected a JSON list of objects, got dict"):
        load_records(write_json(tmp_path / "obj.json", {"prompt": "a"}))
    with pytest.raises(ValueError, match="record 0 is int, expected an object"):
        load_records(write_json(tmp_path / "ints.json", [1]))
    with pytest.raises(ValueError, match=r"record 0 column\(s\) \['response'\] are not strings"):
        load_records(write_json(tmp_path / "num.json", [{"prompt": "a", "response": 3}]))


def test_hub_name_without_datasets_or_network_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name that is not a path goes to the Hub through ``datasets``; missing package or a failed load say so."""
    import importlib
    import types

    real_import = importlib.import_module

    def no_datasets(name: str, *args: object) -> object:
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_datasets)
    with pytest.raises(FileNotFoundError, match="needs the optional 'datasets' package"):
        load_records("Dahoas/rm-static")

    def offline(name: str, split: str) -> object:
        raise ConnectionError("no network")

    fake = types.SimpleNamespace(load_dataset=offline)
    monkeypatch.setattr(
        importlib, "import_module", lambda name, *a: fake if name == "datasets" else real_import(name, *a)
    )
    with pytest.raises(FileNotFoundError, match=r"Hub load failed \(ConnectionError: no network\)"):
        load_records("Dahoas/rm-static")
    rows = [{"prompt": "p", "chosen": "c", "rejected": "r"}]
    fake.load_dataset = lambda name, split: rows
    assert load_records("Dahoas/rm-static") == rows


def test_load_bad_path_and_suffix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no dataset at"):
        load_records(tmp_path / "nope.json")
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,response\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"unsupported file type '\.csv'"):
        load_records(csv)


def test_load_directory_without_datasets_names_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes ``import datasets`` raise ImportError
    with pytest.raises(ImportError, match=r"'datasets' package \(pip install datasets\)"):
        load_records(tmp_path)


def test_load_directory_with_datasets(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(pairs())}).save_to_disk(str(tmp_path / "hf"))
    assert load_records(tmp_path / "hf") == pairs()
    with pytest.raises(ValueError, match=r"no split 'test'; available splits: \['train'\]"):
        load_records(tmp_path / "hf", split="test")


# ------------------------------------------------------------------ splits


def test_split_phases_disjoint_cover_and_proportional() -> None:
    records = list(range(10))
    parts = [split_for_phase(records, "2,4,4", phase, seed=7) for phase in (1, 2, 3)]
    assert [len(p) for p in parts] == [2, 4, 4]
    assert sorted(parts[0] + parts[1] + parts[2]) == records
    assert parts == [split_for_phase(records, "2,4,4", phase, seed=7) for phase in (1, 2, 3)]
    assert parts[2] != split_for_phase(records, "2,4,4", 3, seed=8) or parts[1] != split_for_phase(
        records, "2,4,4", 2, seed=8
    )


@pytest.mark.parametrize("size", [1, 3, 7, 11, 100, 101])
def test_split_rounding_assigns_every_record_once(size: int) -> None:
    records = list(range(size))
    got: list[int] = []
    for phase in (1, 2, 3):
        try:
            got += split_for_phase(records, "1,1,1", phase, seed=0)
        except ValueError:
            pass
    assert sorted(got) == records


def test_split_single_phase_and_fractions() -> None:
    records = list(range(9))
    assert sorted(split_for_phase(records, "10,0,0", 1)) == records
    assert len(split_for_phase(records, "0.5, 0.25, 0.25", 1)) == 5  # 4.5 rounds half up


def test_split_errors_name_split_and_phase() -> None:
    with pytest.raises(ValueError) as err:
        split_for_phase(list(range(10)), "10,0,0", phase=2)
    assert "'10,0,0'" in str(err.value) and "phase 2 no records (of 10)" in str(err.value)
    with pytest.raises(ValueError, match="phase must be 1, 2 or 3, got 4"):
        split_for_phase([1], "1,1,1", phase=4)
    for bad in ("1,1", "a,b,c", "1,-1,1", "0,0,0", "1/0,1,1"):
        with pytest.raises(ValueError, match=f"data split '{bad}'"):
            split_for_phase([1, 2, 3], bad, phase=1)


def test_train_eval_split() -> None:
    records = list(range(20))
    train, held = train_eval_split(records, 0.25, seed=3)
    assert len(held) == 5 and len(train) == 15 and sorted(train + held) == records
    assert (train, held) == train_eval_split(records, 0.25, seed=3)
    assert len(train_eval_split(records, 0.01)[1]) == 1  # at least one held out
    with pytest.raises(ValueError, match=r"eval_fraction must be in \(0, 1\), got 1.0"):
        train_eval_split(records, 1.0)
    with pytest.raises(ValueError, match="eval_fraction 0.5 of 1 record\\(s\\) leaves no training records"):
        train_eval_split([0], 0.5)


# ------------------------------------------------------------------ tokens


def test_sft_example_masks_prompt() -> None:
    ex = sft_example(make_tok(), "q1 q2", "a1 a2", max_len=16)
    input_ids, labels = ex
    assert input_ids == ids("q1 q2") + ids("a1 a2") + [EOS]
    assert labels == [IGNORE_INDEX] * 2 + ids("a1 a2") + [EOS]
    assert ex.n_truncated == 0


def test_sft_example_truncation_counts() -> None:
    tok = make_tok()
    ex = sft_example(tok, "q1 q2", "a1 a2 a3", max_len=4)  # 2 + 4 tokens -> cut the answer tail
    assert ex.input_ids == ids("q1 q2 a1 a2") and ex.labels == [IGNORE_INDEX] * 2 + ids("a1 a2")
    assert ex.n_truncated == 2
    ex = sft_example(tok, "q1 q2 q3 q4 q5", "a1", max_len=3)  # prompt fills the budget: keep its end
    assert ex.input_ids == ids("q4 q5 a1") and ex.labels == [IGNORE_INDEX, IGNORE_INDEX, ids("a1")[0]]
    assert ex.n_truncated == 4
    with pytest.raises(ValueError, match="max_len must be at least 2, got 1"):
        sft_example(tok, "q1", "a1", max_len=1)


def test_pairwise_example() -> None:
    tok = make_tok()
    chosen, rejected = pairwise_example(tok, "q1", "a1 a2", "b1", max_len=8)
    assert chosen == ids("q1 a1 a2") + [EOS] and rejected == ids("q1 b1") + [EOS]
    ex = pairwise_example(tok, "q1", "a1 a2 a3", "b1 b2", max_len=3)
    assert ex.chosen_ids == ids("q1 a1 a2") and ex.rejected_ids == ids("q1 b1 b2")
    assert ex.n_truncated == 2 + 1


def test_prompt_batch_left_pads_and_truncates() -> None:
    batch = prompt_batch(make_tok(), ["q1", "q1 q2 q3 q4 q5", "q2 q3"], max_prompt_len=3)
    input_ids, mask = batch
    assert input_ids.tolist() == [[1, 1] + ids("q1"), ids("q3 q4 q5"), [1] + ids("q2 q3")]
    assert mask.tolist() == [[0, 0, 1], [1, 1, 1], [0, 1, 1]]
    assert batch.counts == {"truncated": 1, "dropped": 0} and batch.kept == [0, 1, 2]


def test_prompt_batch_drop_policy() -> None:
    batch = prompt_batch(make_tok(), ["q1 q2 q3 q4", "q1", "q2 q3"], max_prompt_len=2, policy="drop")
    assert batch.input_ids.tolist() == [[1] + ids("q1"), ids("q2 q3")]
    assert batch.counts == {"truncated": 0, "dropped": 1} and batch.kept == [1, 2]
    with pytest.raises(ValueError, match="all 1 prompt\\(s\\) exceed max_prompt_len 2 and were dropped"):
        prompt_batch(make_tok(), ["q1 q2 q3"], max_prompt_len=2, policy="drop")


def test_prompt_batch_errors() -> None:
    tok = make_tok()
    with pytest.raises(ValueError, match=r"policy must be one of \['truncate', 'drop'\], got 'cut'"):
        prompt_batch(tok, ["q1"], 2, policy="cut")
    with pytest.raises(ValueError, match="needs at least one prompt"):
        prompt_batch(tok, [], 2)
    with pytest.raises(ValueError, match="prompt 1 tokenizes to no tokens"):
        prompt_batch(tok, ["q1", ""], 2)
    with pytest.raises(ValueError, match="max_prompt_len must be positive, got 0"):
        prompt_batch(tok, ["q1"], 0)


def test_missing_pad_token() -> None:
    tok = make_tok(pad=False)
    with pytest.raises(ValueError) as err:
        prompt_batch(tok, ["q1", "q1 q2"], 4)
    assert "set tokenizer.pad_token" in str(err.value) and "pad_to_eos=True" in str(err.value)
    batch = prompt_batch(tok, ["q1", "q1 q2"], 4, pad_to_eos=True)
    assert batch.input_ids.tolist() == [[EOS] + ids("q1"), ids("q1 q2")]
    assert batch.attention_mask.tolist() == [[0, 1], [1, 1]]
    assert pad_token_id(make_tok()) == 1 and pad_token_id(tok, pad_to_eos=True) == EOS


def test_pad_sequences() -> None:
    right = pad_sequences([[5, 6], [7], []], pad_value=0)
    assert right.dtype == torch.long and right.tolist() == [[5, 6], [7, 0], [0, 0]]
    assert pad_sequences([[5, 6], [7]], pad_value=0, left=True).tolist() == [[5, 6], [0, 7]]
    with pytest.raises(ValueError, match="at least one sequence"):
        pad_sequences([], 0)


def test_check_budget() -> None:
    check_budget(1024, 512, 512)
    with pytest.raises(ValueError) as err:
        check_budget(1024, 768, 512)
    msg = str(err.value)
    assert "max_prompt_len 768" in msg and "max_answer_len 512" in msg and "1280" in msg and "1024" in msg
    with pytest.raises(ValueError, match="max_answer_len must be positive, got 0"):
        check_budget(1024, 10, 0)
