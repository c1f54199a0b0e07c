"""Entry point for the plan's two-node exactness test: run under two ``torchrun --nnodes 2`` agents on loopback.

Usage: ``python -m torch.distributed.run --nnodes 2 --node_rank I --nproc_per_node 2 --master_addr 127.0.0.1
--master_port P -m tests.harness.plan_two_node_main OUT_FILE``. Every rank compares the engine with the plan (the
node layout comes from torchrun's LOCAL_WORLD_SIZE, as in a real run); rank 0 writes every rank's mismatches.
"""

from __future__ import annotations

import os
import sys

import torch

if __name__ == "__main__":
    from tests.distributed.test_plan_exactness import NODES, mismatches
    from tests.workers.plan import plan_cases

    results = plan_cases([(spec, gen) for _, spec, gen in NODES])
    mine = mismatches([name for name, _, _ in NODES], results, torch.distributed.get_rank())
    everyone: list[object] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    env = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "WORLD_SIZE")}
    if torch.distributed.get_rank() == 0:
        torch.save({"mismatches": everyone, "env": env}, sys.argv[1])
    torch.distributed.destroy_process_group()
