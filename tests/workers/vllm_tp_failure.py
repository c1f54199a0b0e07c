"""Run under ``torch.distributed.run`` at world 2 (``python -m torch.distributed.run --standalone --nproc_per_node=2
-m tests.workers.vllm_tp_failure MODE OUT``): one vLLM engine of tensor-parallel size 2 over both ranks, fed a ZeRO-3
actor's weights, then rollouts through the real ``vllm_rollout`` path in which vLLM fails:

* ``one``: rank 1's first decoder layer raises on its third forward (mid-generation); rank 0 goes on into vLLM's
  own collectives and blocks there for good. Rank 1 must give the job up (``GroupAbandoned``) instead of waiting;
* ``both``: both ranks' embedding raises before its all-reduce on the first forward of the second rollout: every
  rank fails alike, so every rank raises the same error and the process carries on (each rank writes a record).

Each rank writes ``OUT/rank<r>.json`` when it gets an exception it can report (``error``) or completes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

WAIT_S = 3.0


def _raise_on(call: int, ranks: tuple[int, ...], rank: int) -> Any:
    """A forward (pre-)hook that raises on its ``call``-th run (1-based) on ``ranks``."""
    seen = [0]

    def hook(*_args: Any) -> None:
        seen[0] += 1
        if rank in ranks and seen[0] == call:
            raise RuntimeError(f"injected vLLM failure on rank {rank}")

    return hook


def main(mode: str, out: Path) -> None:
    import hybridzero
    from hybridzero.rlhf.rollout.backends import VLLMEngine, VLLMOptions
    from hybridzero.rlhf.rollout.backends.tp_failure import GroupAbandoned
    from hybridzero.rlhf.rollout.backends.vllm_rollout import vllm_rollout
    from tests.workers.vllm_tp_runs import tp_model

    hybridzero.init_distributed()
    rank = torch.distributed.get_rank()
    model = tp_model()
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}}
    engine, *_ = hybridzero.initialize(model=model, config=cfg, model_parameters=model.parameters())
    opts = VLLMOptions(kv_cache_gb=0.05, max_model_len=64, tensor_parallel_size=2, failure_wait_s=WAIT_S)
    vllm = VLLMEngine(engine.module.config, opts, 2, rank)
    prompts = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.ones_like(prompts)

    def rollout() -> None:
        vllm_rollout(
            vllm,
            engine,
            prompts,
            mask,
            sample_ids=[2 * rank, 2 * rank + 1],
            run_seed=3,
            prompt_width=4,
            answer_len=8,
            pad_id=0,
            eos_id=None,
        )

    record: dict[str, Any] = {"rank": rank, "error": None}
    try:
        rollout()  # starts and syncs the engine; answers on both ranks
        if mode == "one":
            vllm.llm.apply_model(lambda m: m.model.layers[0].register_forward_hook(_raise_on(3, (1,), rank)))
        else:
            vllm.llm.apply_model(lambda m: m.model.embed_tokens.register_forward_pre_hook(_raise_on(1, (0, 1), rank)))
        rollout()
    except Exception as exc:  # noqa: BLE001 - the record is the point
        record["error"] = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, GroupAbandoned):  # the process must end: the launcher ends the job
            (out / f"rank{rank}.json").write_text(json.dumps(record))
            raise
    finally:
        vllm.stop()
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
