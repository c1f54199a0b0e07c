"""The unsupervised (ptx) stream of step 3: LM batches mixed into PPO as separate actor steps.

The stream is on only when both ``unsupervised_dataset_name`` and ``unsupervised_dataset_config_name`` are given
(DeepSpeed-Chat's rule). Records come from ``unsupervised_dataset_name``: ``"demo"``, a JSON/JSONL file or a saved
dataset directory, or a name whose local copy is ``DATA_ROOT/NAME/CONFIG`` or ``DATA_ROOT/NAME`` (e.g. ``wikitext``
``wikitext-2-raw-v1``: its ``train`` split). A record with a ``text`` column is that text (DeepSpeed-Chat's ptx
data); one with ``prompt``/``response`` (or pairwise) columns is ``prompt + response``; either ends with eos and has
the LM loss on every token (pretraining-style). Batches are global batches of
``per_device_training_batch_size x D`` records over the ``D`` data-parallel ranks (the world, or ``W / s`` under
sequence parallelism, whose SP groups share a slice) in a seeded order that restarts (reshuffled) when exhausted;
data rank ``r`` takes slice ``r``. The stream is a pure function of the number of batches drawn, so a resumed run can
re-position it with :meth:`PtxStream.skip`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridzero.rlhf.data.dealing import epoch_order, rank_slice
from hybridzero.rlhf.data.demo_task import demo_data_dir
from hybridzero.rlhf.data.dschat import DATA_ROOT_ENV
from hybridzero.rlhf.data.records import load_records
from hybridzero.rlhf.data.sources import (
    read_hf_directory,
    read_json_file,
    read_jsonl_file,
)
from hybridzero.rlhf.data.tokens import IGNORE_INDEX, pad_sequences, sft_example
from hybridzero.rlhf.settings import PPOSettings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["PtxStream", "unsupervised_records"]


def _local_unsupervised(name: str, config: str | None, data_root: str | None) -> Path | None:
    """The local copy of a ptx dataset: ``name`` as a path, else ``DATA_ROOT/name/config``, else ``DATA_ROOT/name``."""
    if Path(name).exists():
        return Path(name)
    root = data_root or os.environ.get(DATA_ROOT_ENV)
    if not root:
        return None
    for candidate in ([Path(root) / name / config] if config else []) + [Path(root) / name]:
        if candidate.exists():
            return candidate
    return None


def unsupervised_records(name: str, config: str | None, data_root: str | None) -> list[tuple[str, str]]:
    """``(prompt, text)`` pairs of the ptx dataset (module docstring); the prompt is empty for ``text`` rows."""
    if name == "demo":
        return [(r["prompt"], r["response"]) for r in load_records(demo_data_dir() / "sft.jsonl")]
    copy = _local_unsupervised(name, config, data_root)
    if copy is None:
        raise FileNotFoundError(
            f"unsupervised_dataset_name {name!r} (config {config!r}): no local copy as a path, "
            f"or under --data_root as NAME/CONFIG or NAME (data_root {data_root!r})"
        )
    if copy.is_dir() and not (copy / "train.jsonl").exists():
        rows = read_hf_directory(copy, "train")
    else:
        rows = (
            read_jsonl_file(copy / "train.jsonl" if copy.is_dir() else copy)
            if copy.suffix != ".json"
            else read_json_file(copy)
        )
    out: list[tuple[str, str]] = []
    for index, row in enumerate(rows):
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            if row["text"].strip():  # DeepSpeed-Chat's wikitext rows include blank lines; they carry no tokens
                out.append(("", row["text"]))
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            out.append((row["prompt"], str(row.get("response", row.get("chosen", "")))))
        else:
            why = f"unsupervised_dataset_name {name!r}: record {index} has neither a 'text' nor a 'prompt' column"
            raise ValueError(why)  # noqa: TRY004 - bad data, not a programming error
    if not out:
        raise ValueError(f"unsupervised_dataset_name {name!r}: no non-empty records in {copy}")
    return out


class PtxStream:
    """Endless, deterministic ptx batches for this rank (see module docstring)."""

    def __init__(self, s: PPOSettings, tok: PreTrainedTokenizerBase, pad_id: int, rank: int, world: int) -> None:
        name = s.unsupervised_dataset_name
        assert name is not None
        max_len = s.max_prompt_seq_len + s.max_answer_seq_len
        self.examples = [
            sft_example(tok, prompt, text, max_len).input_ids
            for prompt, text in unsupervised_records(name, s.unsupervised_dataset_config_name, s.data_root)
        ]
        self.batch = s.per_device_training_batch_size
        if len(self.examples) < self.batch * world:
            raise ValueError(
                f"unsupervised_dataset_name {name!r}: {len(self.examples)} record(s) cannot fill one "
                f"ptx batch of {self.batch * world}"
            )
        self.pad_id, self.rank, self.world, self.seed = pad_id, rank, world, s.seed + 17
        self.drawn = 0

    def skip(self, n: int) -> None:
        """Advance past ``n`` batches (resume)."""
        self.drawn += n

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next batch: ``input_ids``, ``attention_mask``, ``labels`` (-100 on padding), right-padded."""
        span = self.batch * self.world
        per_epoch = len(self.examples) // span
        epoch, pos = divmod(self.drawn, per_epoch)
        order = epoch_order(len(self.examples), self.seed, epoch)
        mine = rank_slice(order[pos * span : (pos + 1) * span], self.rank, self.world)
        self.drawn += 1
        rows = [self.examples[i] for i in mine]
        ids = pad_sequences(rows, self.pad_id)
        mask = pad_sequences([[1] * len(r) for r in rows], 0)
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, IGNORE_INDEX))
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
