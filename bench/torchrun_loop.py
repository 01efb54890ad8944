"""The training loop under bare torchrun, for bench/elastic_bench.py's cold-start baseline.

    torchrun --standalone --nproc_per_node 3 bench/torchrun_loop.py --folder F --spec JSON

Rank 0 appends every step's wall clock to F/steps.jsonl, like the Ray Train baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from step_log import FileHooks, SilentHooks

from elastrain.contracts.spec import JobSpec
from elastrain.workers.api import TrainContext
from elastrain.workers.loop import train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ctx = TrainContext(
        rank=rank,
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        device=torch.device("cpu"),
        job_id=0,
        attempt=1,
        checkpoint_root=args.folder / "checkpoints",
    )
    hooks = FileHooks(args.folder) if rank == 0 else SilentHooks(args.folder)
    train(ctx, JobSpec.model_validate(json.loads(args.spec)), hooks)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
