"""Per-rank script of ``test_hf_zero3_resize.py``: Hugging Face's own ZeRO-3 paths before ``initialize``, through the
DeepSpeed alias, as a DeepSpeed user's script runs them.

With transformers' ``HfDeepSpeedConfig`` alive, ``from_pretrained`` builds the model inside ``deepspeed.zero.Init``
and loads it inside ``GatheredParameters``; ``resize_token_embeddings`` reads the old shapes inside
``GatheredParameters`` and builds the new embedding and head whole. Both run on parameters that are size 0 outside a
gather, as under DeepSpeed. Run: ``torchrun --nproc_per_node 3 tests/integration/hf_zero3_resize_script.py --model
DIR --out DIR``; each rank writes ``DIR/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import hybridzero.as_deepspeed  # noqa: F401  (the only addition to a DeepSpeed script: `deepspeed` is hybridzero)

GROWN = 107  # from a vocabulary of 101; a multiple of no world size above 1


def load_and_resize(path: Path) -> object:
    """``from_pretrained`` under seed 1, then ``resize_token_embeddings`` under seed 2 (the new rows come from the
    model's own init)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(2)
    model.resize_token_embeddings(GROWN, mean_resizing=False)
    return model


def main() -> None:
    import deepspeed
    import torch
    from transformers.integrations import HfDeepSpeedConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    want = {n: p.detach().clone() for n, p in load_and_resize(args.model).named_parameters()}
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    keep = HfDeepSpeedConfig(ds)  # noqa: F841  (transformers sees ZeRO-3 while this lives)
    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    torch.manual_seed(1)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    norm = model.model.norm.weight
    loaded = [list(norm.shape), list(norm.ds_shape)]
    torch.manual_seed(2)
    model.resize_token_embeddings(GROWN, mean_resizing=False)
    resized = [list(model.lm_head.weight.shape), list(model.model.embed_tokens.weight.shape)]
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    got = engine.full_parameters()
    mismatched = [n for n in want if n not in got or not torch.equal(got[n], want[n])]
    engine.destroy()
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"loaded": loaded, "resized": resized, "mismatched": mismatched}
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
