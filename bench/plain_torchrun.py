"""A plain torchrun training script, the baseline for bench/step_overhead_bench.py: what a
user would write without elastrain (no Ray, no service, no checkpoints, no metrics
pipeline), for the same gpt model, data, global batch and strategy.

    torchrun --standalone --nproc_per_node 2 bench/plain_torchrun.py \
        --strategy ddp --steps 60 --out times.json

Rank 0 writes the wall clock at the end of every optimizer step to `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.nn.parallel import DistributedDataParallel

from workers.workloads.gpt import build


def clip_over_stages(stage: torch.nn.Module, max_norm: float) -> None:
    """Clip to the whole model's gradient norm, as a pipeline script must (torchtitan's
    `clip_grad_norm_` with a pp mesh): each stage's squared norm summed over the stages.
    Clipping each stage by its own norm would train a different model than DDP does. The
    bench runs one replica, so the stages are every rank (the default group)."""
    grads = [p.grad for p in stage.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads) ** 2
    dist.all_reduce(total)
    torch.nn.utils.clip_grads_with_norm_(stage.parameters(), max_norm, total.sqrt())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "fsdp", "pipeline"], required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument(
        "--params", default='{"n_layer": 2, "n_embd": 64, "n_head": 4, "seq_len": 64}'
    )
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    workload = build(**json.loads(args.params))
    model, data = workload.model, workload.dataset
    loss_fn = workload.loss_fn

    stages = 2 if args.strategy == "pipeline" else 1
    replicas = world // stages
    replica = rank // stages
    share = args.global_batch // replicas  # samples per replica per step
    if args.strategy == "ddp":
        model = DistributedDataParallel(model)
    elif args.strategy == "fsdp":
        for block in model.blocks.values():
            fully_shard(block)
        fully_shard(model)
    else:
        model = model.pipeline_stage(rank % stages, stages)
        stage = PipelineStage(model, rank % stages, stages, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=share // args.micro_batch,
                                loss_fn=lambda out, y: loss_fn(out, y))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = (step * args.global_batch + replica * share) % (len(data) - share)
        xs, ys = zip(*(data[first + i] for i in range(share)), strict=True)
        return torch.stack(xs), torch.stack(ys)

    times: list[float] = []
    for step in range(args.steps):
        x, y = batch(step)
        optimizer.zero_grad(set_to_none=True)
        if args.strategy == "pipeline":
            if rank % stages == 0:
                schedule.step(x)
            else:
                schedule.step(target=y)
        else:
            chunks = list(zip(x.split(args.micro_batch), y.split(args.micro_batch), strict=True))
            for i, (xm, ym) in enumerate(chunks):
                last = i == len(chunks) - 1
                if args.strategy == "ddp" and not last:
                    with model.no_sync():
                        (loss_fn(model(xm), ym) / len(chunks)).backward()
                else:
                    if args.strategy == "fsdp":
                        model.set_requires_gradient_sync(last)
                    (loss_fn(model(xm), ym) / len(chunks)).backward()
        if args.strategy == "pipeline":
            clip_over_stages(model, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        times.append(time.time())
    if rank == 0:
        args.out.write_text(json.dumps(times))
    dist.barrier()  # no rank tears down its gloo pairs while a peer still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
