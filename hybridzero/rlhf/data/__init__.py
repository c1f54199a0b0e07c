"""RLHF data: records and their sources (:mod:`.records`, :mod:`.sources`), tokenization (:mod:`.tokens`), how
global batches are dealt to ranks (:mod:`.dealing`), step 3's unsupervised stream (:mod:`.ptx`) and the embedded demo's
task (:mod:`.demo_task`: vocabulary, tokenizer, tiny model config, data files, the hidden rule)."""

from __future__ import annotations

from hybridzero.rlhf.data.dealing import Plan, epoch_order, make_plan, rank_prompts, rank_slice, steps_per_epoch
from hybridzero.rlhf.data.records import (
    DEMO_FILES,
    PAIRWISE_COLUMNS,
    SFT_COLUMNS,
    load_records,
    phase_records,
    phase_train_eval,
    split_for_phase,
    train_eval_split,
)
from hybridzero.rlhf.data.tokens import (
    IGNORE_INDEX,
    PROMPT_POLICIES,
    PairwiseExample,
    PromptBatch,
    SFTExample,
    check_budget,
    load_prompts,
    pad_sequences,
    pad_token_id,
    pairwise_example,
    prompt_batch,
    prompt_tensors,
    sft_example,
)

__all__ = [
    "DEMO_FILES",
    "IGNORE_INDEX",
    "PAIRWISE_COLUMNS",
    "PROMPT_POLICIES",
    "SFT_COLUMNS",
    "PairwiseExample",
    "Plan",
    "PromptBatch",
    "SFTExample",
    "check_budget",
    "epoch_order",
    "load_prompts",
    "load_records",
    "make_plan",
    "pad_sequences",
    "pad_token_id",
    "pairwise_example",
    "phase_records",
    "phase_train_eval",
    "prompt_batch",
    "prompt_tensors",
    "rank_prompts",
    "rank_slice",
    "sft_example",
    "split_for_phase",
    "steps_per_epoch",
    "train_eval_split",
]
