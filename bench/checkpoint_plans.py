"""What DCP's planning and exchanges cost a save, and what kept plans save of it.

Run by bench/checkpoint_bench.py (`--only plans`, its third report block). N gloo ranks
(spawned; N = 2 and 4 by default), each holding the one-rank GIL proxy's model
(bench/checkpoint_gil.py: a 12-layer GPT with AdamW, ~600 tensors, plus frozen
parameters) as a replicated state, as a DDP job's is: DCP gives each item to one rank.
Synchronous saves, alternating between two checkpointers: one keeping its plans
(`save_plans`) and saving without DCP's exchanges once every rank holds them
(`kept_save`), one planning every save as DCP does (`keep_plans=False`). Per save, per
rank: the CPU of the saving thread (all of it Python and syscalls holding the training
process's time: a sync save's whole cost on a busy host, the GIL held beside training on
an async one) and the wall time, medians over the repeats after the first.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from bench.checkpoint_gil import VOCAB, build
from elastrain.checkpoints.dcp import ShardedCheckpointer
from elastrain.workers.workloads.gpt import lm_loss

SIDES = {"kept plans": True, "planned every save": False}


def body(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank: the two checkpointers' saves, alternating, timed."""
    torch.set_num_threads(1)
    model, optim = build(cfg["frozen_mb"], 2)
    x = torch.randint(0, VOCAB, (8, 65))
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    optim.step()  # the optimizer's state exists
    ckpts = {
        side: ShardedCheckpointer(
            Path(cfg["dir"]) / side.replace(" ", "-"),
            rank=rank,
            world_size=world_size,
            async_save=False,
            keep_plans=keep,
        )
        for side, keep in SIDES.items()
    }
    times: dict[str, list[tuple[float, float]]] = {side: [] for side in SIDES}
    step = 0
    for repeat in range(cfg["repeats"] + 1):  # the first saves plan for both: not counted
        order = list(SIDES) if repeat % 2 else list(reversed(SIDES))
        for side in order:
            step += 1
            m, o = get_state_dict(model, optim)
            cpu, wall = time.thread_time(), time.perf_counter()
            ckpts[side].save(
                step=step, attempt=0, state={"model": m, "optim": o}, manifest_fields={}
            )
            ckpts[side].finalize()
            if repeat:
                times[side].append((time.thread_time() - cpu, time.perf_counter() - wall))
    tensors = len(m) + sum(len(v) for v in o["state"].values())
    for ckpt in ckpts.values():
        ckpt.close()
    return {
        "tensors": tensors,
        "cpu": {s: statistics.median(c for c, _ in t) for s, t in times.items()},
        "wall": {s: statistics.median(w for _, w in t) for s, t in times.items()},
    }


def render(cfg: dict[str, Any], runs: dict[int, list[dict[str, Any]]]) -> str:
    """`runs`: world size -> each rank's `body` result."""
    tensors = next(iter(runs.values()))[0]["tensors"]
    lines = [
        "## DCP's planning and exchanges against kept plans (sync saves, N ranks)",
        "",
        f"`{cfg['command']}`: N gloo ranks on {cfg['cores']} cores (torch "
        f"{torch.__version__}), each holding the GIL proxy's model as a replicated state "
        f"({tensors} tensors, {cfg['frozen_mb']} MB frozen), synchronous saves alternating "
        "between a checkpointer keeping its plans and one planning every save as DCP does; "
        f"medians of {cfg['repeats']} saves each. Load average (1, 5, 15 min) at the start "
        f"{_fmt(cfg['load_before'])}, at the end {_fmt(cfg['load_after'])}.",
        "",
        "| ranks | rank | CPU per save, kept plans (ms) | planned every save (ms) | wall per "
        "save, kept plans (ms) | planned every save (ms) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for world, results in sorted(runs.items()):
        for rank, r in enumerate(results):
            cpu, wall = r["cpu"], r["wall"]
            lines.append(
                f"| {world} | {rank} | {cpu['kept plans'] * 1e3:.1f} | "
                f"{cpu['planned every save'] * 1e3:.1f} | {wall['kept plans'] * 1e3:.1f} | "
                f"{wall['planned every save'] * 1e3:.1f} |"
            )
    lines.append("")
    return "\n".join(lines)


def _fmt(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)
