"""A plain torchrun script: DDP over gloo, its own checkpoint, nothing of elastrain.

Runs the same under `torchrun --nproc-per-node 2 train.py` and as an elastrain command
job (examples/torchrun.yaml). It reads only what torchrun sets (RANK, WORLD_SIZE,
MASTER_ADDR, ..., TORCHELASTIC_RESTART_COUNT) and keeps its checkpoint in
$ELASTRAIN_JOB_DIR when that is set (else --ckpt-dir): after a restart, at whatever world
size, it resumes from there. The global batch is the same at every world size (each rank
takes its share), so the loss curve does not depend on how many ranks ran it.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

GLOBAL_BATCH = 32


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: the same whatever the world size."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True)).sin()
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.0, help="sleep per step (demo)")
    parser.add_argument("--ckpt-dir", default="checkpoints")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt_dir = Path(os.environ.get("ELASTRAIN_JOB_DIR") or args.ckpt_dir)
    ckpt = ckpt_dir / "ckpt.pt"

    model = DistributedDataParallel(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        print(f"rank {rank}: resumed from step {start} at world size {world} "
              f"(restart {restart})", flush=True)  # fmt: skip

    for step in range(start + 1, args.steps + 1):
        x, y = batch(step)
        mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        opt.zero_grad()
        loss.backward()
        opt.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        if rank == 0:
            print(f"step {step} loss {reported.item() / world:.5f} world_size {world}", flush=True)
        if rank == 0 and (step % args.save_every == 0 or step == args.steps):
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "step": step}, tmp)  # fmt: skip
            os.replace(tmp, ckpt)  # atomic: a restart never reads half a checkpoint
        if args.step_time:
            time.sleep(args.step_time)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
