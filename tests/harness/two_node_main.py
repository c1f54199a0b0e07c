"""Entry point for the two-node hpZ test: run under two ``torchrun --nnodes 2`` agents on loopback.

Usage: ``python -m torch.distributed.run --nnodes 2 --node_rank I --nproc_per_node 2 --master_addr 127.0.0.1
--master_port P -m tests.harness.two_node_main OUT_FILE``. Rank 0 writes the hpZ-off and hpZ-2 results.
"""

from __future__ import annotations

import os
import sys

import torch

if __name__ == "__main__":
    from tests.harness.parity import RunSpec
    from tests.workers.hpz import hpz_run

    spec = RunSpec(
        model="gpt2_tied",
        steps=4,
        accumulation=2,
        dtype="fp16",
        lr=1e-3,
        clipping=1.0,
        with_scalar=True,
        persistence_threshold=40,
        frozen=("wpe",),
        inf_at=((1, 1),),
        fp16={"initial_scale_power": 8},
        edit=("model.transformer.h.1.mlp.c_fc.weight",),
        prefetch_bucket_size=10**9,
    )
    results = {h: hpz_run(spec.replace(extra_zero={"zero_hpz_partition_size": h}), "non_reentrant") for h in (1, 2)}
    results["env"] = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "WORLD_SIZE")}
    if torch.distributed.get_rank() == 0:
        torch.save(results, sys.argv[1])
    torch.distributed.destroy_process_group()
