"""DeepSpeed-Chat's optimizer semantics on the sharded engine: the weight-decay groups (no decay on biases and norm
weights) and a ``transformers.get_scheduler`` curve, at world 1 and world 3 (tiny Llama, odd dims)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from hybridzero.rlhf.data.demo_task import build_tokenizer, demo_model_config
from hybridzero.rlhf.engines import decay_groups
from hybridzero.rlhf.runlog.metrics import read_metrics
from tests.workers.dschat_optim import optimizer_groups_run
from tests.workers.rlhf_runs import sft_run


@pytest.mark.timeout(600)
def test_decay_groups_and_hf_schedule_match_across_worlds(world, tmp_path: Path) -> None:
    settings = {
        "per_device_train_batch_size": 4,
        "max_seq_len": 24,
        "progress": False,
        "print_every": 1000,
        "eval_fraction": 0.02,
        "max_steps": 4,
        "learning_rate": 3e-3,
        "weight_decay": 0.5,
        "lr_scheduler_type": "polynomial",
        "num_warmup_steps": 1,
        "enable_tensorboard": False,
    }
    runs: dict[int, tuple[list[dict[str, float]], dict[str, torch.Tensor]]] = {}
    for n, batch in ((1, 12), (3, 4)):
        out = tmp_path / f"w{n}"
        world(n).run(sft_run, dict(settings, output_dir=str(out), per_device_train_batch_size=batch), timeout=300)
        runs[n] = (read_metrics(out), load_file(str(out / "model.safetensors")))
    (rows1, w1), (rows3, w3) = runs[1], runs[3]
    lrs = [r["lr"] for r in rows1 if r["phase"] == "sft"]
    assert lrs == [r["lr"] for r in rows3 if r["phase"] == "sft"]
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    ref = transformers.get_scheduler("polynomial", opt, num_warmup_steps=1, num_training_steps=4)
    want = []
    for _ in range(4):  # the lr each logged step trained with, then the scheduler moved on
        want.append(opt.param_groups[0]["lr"])
        opt.step(), ref.step()
    assert lrs == pytest.approx(want[1:] + [opt.param_groups[0]["lr"]]) or lrs == pytest.approx(want)
    # Weights are not compared element-wise: Adam turns fp32 reduction-order noise in near-zero gradients into
    # lr-sized steps (measured max |w1 - w3| after these 4 steps: 8.3e-3 with or without the decay groups, 1.6e-3
    # with the old warmup_cosine schedule's smaller lrs). The losses agree closely.
    eval1, eval3 = (next(r for r in rows if r["phase"] == "sft_eval") for rows in (rows1, rows3))
    assert eval1["eval_loss"] == pytest.approx(eval3["eval_loss"], rel=2e-3)
    assert set(w1) == set(w3) and all(w1[k].shape == w3[k].shape for k in w1)


def test_sharded_optimizer_groups_hold_decayed_and_plain_elements(world) -> None:
    """At ZeRO-3 on 3 ranks the engine's two optimizer groups hold exactly the decayed and the plain parameters
    (the demo model's tensors are all below ZeRO-3's persistence threshold, so every rank steps them whole)."""
    model = transformers.AutoModelForCausalLM.from_config(demo_model_config(build_tokenizer()))
    decayed, plain = decay_groups(model, 0.5)
    want = [(0.5, sum(p.numel() for p in decayed["params"])), (0.0, sum(p.numel() for p in plain["params"]))]
    per_rank = world(3).run(optimizer_groups_run, 0.5)
    assert all(groups == want for groups in per_rank), per_rank
    assert len(world(1).run(optimizer_groups_run, 0.0)[0]) == 1  # no decay: one group, as before
