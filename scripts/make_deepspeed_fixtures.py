"""Write the DeepSpeed checkpoint fixtures of ``tests/test_from_deepspeed.py`` with the real DeepSpeed 0.19.8.

Run it with a Python that has DeepSpeed (never the project's ``.venv``: an installed DeepSpeed would shadow the
``deepspeed`` alias), on CPU/gloo, world 2::

    python3 -m venv /tmp/dsvenv && DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install torch==2.13.0 deepspeed==0.19.8 \\
        transformers==5.24.0 safetensors==0.8.0
    /tmp/dsvenv/bin/python scripts/make_deepspeed_fixtures.py tests/fixtures/deepspeed_0.19.8

For each case (ZeRO-1/2/3 in fp32, ZeRO-2 in bf16) it trains a tiny Llama (one block, dims whose numels are not
divisible by 2, 3 or 4) for ``N`` steps with AdamW (``torch_adam``), WarmupLR and clipping, saves a checkpoint
(``CASE/ckpt/latest``, ``CASE/ckpt/global_stepN/...``: DeepSpeed's own files), trains ``M`` more steps, and writes
``CASE/record.json`` (config, HF model config, the token ids of every step and rank, the per-rank losses and the lr
of all ``N + M`` steps, Adam's step and the lr at the save) and ``CASE/record.safetensors`` (the fp32 masters after
``N + M`` steps; ``saved/exp_avg/P`` and ``saved/exp_avg_sq/P`` of one parameter ``P`` at the save).
DeepSpeed's optimizer files are left as DeepSpeed wrote them.
"""

# ruff: noqa: PLC0415 - DeepSpeed and torch load only inside the worker, after DS_ACCELERATOR is set
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

N_STEPS, M_STEPS, MICRO, SEQ, WORLD = 3, 3, 2, 12, 2
PROBE = "model.embed_tokens.weight"
CASES: dict[str, dict[str, Any]] = {
    "zero1_fp32": {"stage": 1, "bf16": False},
    "zero2_fp32": {"stage": 2, "bf16": False},
    "zero3_fp32": {"stage": 3, "bf16": False},
    "zero2_bf16": {"stage": 2, "bf16": True},
}
HF_CONFIG: dict[str, Any] = {
    "vocab_size": 113,
    "hidden_size": 35,
    "intermediate_size": 67,
    "num_hidden_layers": 1,
    "num_attention_heads": 5,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def ds_config(stage: int, bf16: bool) -> dict[str, Any]:
    """The DeepSpeed JSON of one case (hybridzero reads the same JSON in the test)."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1 << 30,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 2e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-2, "warmup_num_steps": 4, "warmup_type": "linear"},
        },
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage},
    }


def token_ids(vocab: int) -> list[list[list[list[int]]]]:
    """Token ids of every step, rank, sample: ``[N + M][WORLD][MICRO][SEQ]``; each sample counts up from its own
    start with its own stride (mod the vocabulary), from a pool of 8 visited in turn, so the loss falls visibly."""
    pool = [[3 + (11 * k + j * (1 + k % 3)) % (vocab - 3) for j in range(SEQ)] for k in range(8)]
    per_step = WORLD * MICRO
    flat = [pool[(s * per_step + i) % len(pool)] for s in range(N_STEPS + M_STEPS) for i in range(per_step)]
    return [
        [[flat[(s * WORLD + r) * MICRO + m] for m in range(MICRO)] for r in range(WORLD)]
        for s in range(N_STEPS + M_STEPS)
    ]


def full_fp32(engine: Any, key: str | None) -> dict[str, Any]:
    """Every parameter's full fp32 master (``key`` None) or optimizer state ``key``, gathered on every rank."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        t = safe_get_full_fp32_param(p) if key is None else safe_get_full_optimizer_state(p, key)
        out[name] = t.detach().float().cpu().contiguous().clone()
    return out


def worker(case: str, out: Path) -> None:
    """One rank of one case (under torch.distributed.run)."""
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist
    import transformers
    from deepspeed.accelerator import get_accelerator
    from safetensors.torch import save_file

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:  # no JIT-built shared-memory op: plain gloo (as bench/peer_deepspeed.py)
        deepspeed.ops.__compatible_ops__[builder.NAME] = False
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    spec = CASES[case]
    config = ds_config(spec["stage"], spec["bf16"])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG, attn_implementation="eager"))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ids = token_ids(HF_CONFIG["vocab_size"])
    losses, lrs = [], []
    saved: dict[str, Any] = {}
    for step in range(N_STEPS + M_STEPS):
        batch = torch.tensor(ids[step][rank])
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
        lrs.append(float(engine.get_lr()[0]))
        if step + 1 == N_STEPS:
            engine.save_checkpoint(str(out / "ckpt"))
            saved = {k: full_fp32(engine, k)[PROBE] for k in ("exp_avg", "exp_avg_sq")}
    final = full_fp32(engine, None)
    all_losses = [None] * WORLD
    dist.all_gather_object(all_losses, losses)
    if rank == 0:
        tensors = {f"final/{k}": v for k, v in final.items()}
        tensors.update({f"saved/{k}/{PROBE}": v for k, v in saved.items()})
        save_file(tensors, str(out / "record.safetensors"))
        record = {
            "deepspeed": deepspeed.__version__,
            "torch": torch.__version__,
            "world_size": WORLD,
            "n_steps": N_STEPS,
            "m_steps": M_STEPS,
            "config": config,
            "hf_config": HF_CONFIG,
            "token_ids": ids,
            "losses": all_losses,
            "lr": lrs,
            "probe": PROBE,
        }
        (out / "record.json").write_text(json.dumps(record, indent=1))
    dist.barrier()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="fixture directory (tests/fixtures/deepspeed_0.19.8)")
    p.add_argument("--case", choices=sorted(CASES), default=None, help="(internal) run one rank of this case")
    args = p.parse_args()
    if args.case is not None:
        worker(args.case, args.out)
        return 0
    for case in CASES:
        target = args.out / case
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--master_port=29731"]
        subprocess.run([*cmd, __file__, str(target), "--case", case], check=True)
        for script in (target / "ckpt").glob("*.py"):  # DeepSpeed copies its own scripts next to a save: not ours
            script.unlink()
        print(f"{case}: {sum(f.stat().st_size for f in target.rglob('*') if f.is_file())} bytes", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
