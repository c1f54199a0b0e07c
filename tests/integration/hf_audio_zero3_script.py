"""Per-rank script of ``test_hf_audio_zero3.py``: a Hugging Face wav2vec2 CTC model under ZeRO-3 through the
DeepSpeed alias, as DeepSpeed users run it.

Under ``deepspeed.zero.Init`` wav2vec2's positional convolution applies torch's ``weight_norm`` to its partitioned
weight inside ``GatheredParameters`` and registers the two new parameters with
``deepspeed.zero.register_external_parameter``. Run: ``torchrun --nproc_per_node 2
tests/integration/hf_audio_zero3_script.py --out DIR``; each rank writes ``DIR/rank<r>.json`` (per-step losses and
the root group's parameter names).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import hybridzero.as_deepspeed  # noqa: F401  (the only addition to a DeepSpeed script: `deepspeed` is hybridzero)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import deepspeed
    import torch
    from transformers import Wav2Vec2ForCTC
    from transformers.integrations import HfDeepSpeedConfig

    from tests.integration.hf_audio_common import LR, STEPS, audio_batch, audio_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
    }
    keep = HfDeepSpeedConfig(ds)  # noqa: F841  (transformers sees ZeRO-3 while this lives)
    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = Wav2Vec2ForCTC(audio_config())
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    losses = []
    for step in range(STEPS):
        x, labels = audio_batch(step, rank)
        loss = engine(input_values=x, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    root = [s.spec.name for s in engine.coordinator.groups[0].slots]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps({"losses": losses, "root": root}))
    engine.destroy()


if __name__ == "__main__":
    main()
