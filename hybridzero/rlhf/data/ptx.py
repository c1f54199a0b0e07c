"""The unsupervised (ptx) stream of step 3: LM batches mixed into PPO as separate actor steps.

Records come from ``unsupervised_dataset_name`` (a JSON/JSONL file or a saved dataset directory with
``prompt``/``response`` or pairwise columns, or ``"demo"``); each is ``prompt + response + eos`` with the LM loss on
every token (pretraining-style, like DeepSpeed-Chat's ptx data). Batches are global batches of
``per_device_training_batch_size x W`` records in a seeded order that restarts (reshuffled) when exhausted; rank
``r`` takes slice ``r``. The stream is a pure function of the number of batches drawn, so a resumed run can
re-position it with :meth:`PtxStream.skip`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridzero.rlhf.data.dealing import epoch_order, rank_slice
from hybridzero.rlhf.data.records import load_records
from hybridzero.rlhf.data.tokens import IGNORE_INDEX, pad_sequences, sft_example
from hybridzero.rlhf.demo.task import demo_data_dir
from hybridzero.rlhf.settings import PPOSettings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["PtxStream"]


class PtxStream:
    """Endless, deterministic ptx batches for this rank (see module docstring)."""

    def __init__(self, s: PPOSettings, tok: PreTrainedTokenizerBase, pad_id: int, rank: int, world: int) -> None:
        name = s.unsupervised_dataset_name
        assert name is not None
        if name == "demo":
            records = load_records(demo_data_dir() / "sft.jsonl")
        else:
            records = load_records(name)
        max_len = s.max_prompt_seq_len + s.max_answer_seq_len
        self.examples = [sft_example(tok, r["prompt"], r.get("response", r.get("chosen", "")), max_len).input_ids
                         for r in records]
        self.batch = s.per_device_training_batch_size
        if len(self.examples) < self.batch * world:
            raise ValueError(f"unsupervised_dataset_name {name!r}: {len(self.examples)} record(s) cannot fill one "
                             f"ptx batch of {self.batch * world}")
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
        mine = rank_slice(order[pos * span:(pos + 1) * span], self.rank, self.world)
        self.drawn += 1
        rows = [self.examples[i] for i in mine]
        ids = pad_sequences(rows, self.pad_id)
        mask = pad_sequences([[1] * len(r) for r in rows], 0)
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, IGNORE_INDEX))
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
