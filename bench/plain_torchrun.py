"""A plain torchrun training script, the baseline for bench/step_overhead_bench.py: what a
user would write without elastrain (no Ray, no service, no checkpoints, no metrics
pipeline), for the same gpt model, data, global batch and strategy.

    torchrun --standalone --nproc_per_node 2 bench/plain_torchrun.py \
        --strategy ddp --steps 60 --out times.json

Rank 0 writes the wall clock at the end of every optimizer step to `--out`.

`--device cuda --precision bf16` is bench/gpu_check.py's baseline: one GPU per rank
(`LOCAL_RANK`), NCCL, and bf16 as the service's strategies use it (DDP: autocast around
the forward, fp32 parameters; FSDP2: bf16 parameters in compute, fp32 gradient reduction
and sharded master weights).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.nn.parallel import DistributedDataParallel

from elastrain.contracts.workload_params import GptParams
from elastrain.workers.workloads.gpt import build


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
    parser.add_argument(
        "--sync-every-step", action="store_true",
        help="read the loss on the host before each update, as the service's step does "
        "(its step agreement): the reference that shows what that sync costs",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument(
        "--params", default='{"n_layer": 2, "n_embd": 64, "n_head": 4, "seq_len": 64}'
    )
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile each block's forward first"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    low = torch.bfloat16 if args.precision == "bf16" else None
    torch.manual_seed(0)
    workload = build(GptParams.model_validate(json.loads(args.params)))
    model, data = workload.model, workload.dataset
    loss_fn = workload.loss_fn

    stages = 2 if args.strategy == "pipeline" else 1
    replicas = world // stages
    replica = rank // stages
    share = args.global_batch // replicas  # samples per replica per step
    model = model.to(device)
    if args.compile:  # per block, as torchtitan and `training.compile` do
        for block in model.blocks.values():
            block.forward = torch.compile(block.forward)
    if args.strategy == "ddp":
        model = DistributedDataParallel(model)
    elif args.strategy == "fsdp":
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
        for block in model.blocks.values():
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    else:
        model = model.pipeline_stage(rank % stages, stages)
        stage = PipelineStage(model, rank % stages, stages, device)
        schedule = Schedule1F1B(stage, n_microbatches=share // args.micro_batch,
                                loss_fn=lambda out, y: loss_fn(out, y))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = (step * args.global_batch + replica * share) % (len(data) - share)
        xs, ys = zip(*(data[first + i] for i in range(share)), strict=True)
        return torch.stack(xs).to(device), torch.stack(ys).to(device)

    def forward_loss(xm: torch.Tensor, ym: torch.Tensor) -> torch.Tensor:
        if args.strategy == "ddp" and low is not None:
            with torch.autocast(device.type, dtype=low):  # the forward only, as the service
                return loss_fn(model(xm), ym)
        return loss_fn(model(xm), ym)

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
                        (forward_loss(xm, ym) / len(chunks)).backward()
                else:
                    if args.strategy == "fsdp":
                        model.set_requires_gradient_sync(last)
                    (forward_loss(xm, ym) / len(chunks)).backward()
        if args.strategy == "pipeline":
            clip_over_stages(model, 1.0)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if args.sync_every_step:
                norm.item()  # one host sync per step, before the update
        optimizer.step()
        times.append(time.time())
    if device.type == "cuda":
        # No sync per step (a plain script lets the CPU run ahead); the last step's time is
        # when its kernels are done, so the span from an earlier step to it is true.
        torch.cuda.synchronize()
        times[-1] = time.time()
    if rank == 0:
        args.out.write_text(json.dumps(times))
    dist.barrier()  # no rank tears down its gloo pairs while a peer still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
