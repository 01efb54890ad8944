"""The GPU host's async-save regime on CPU: one rank, one torch thread, a spare core.

Run by bench/checkpoint_bench.py (its second report block). On a GPU host the training
loop is host-bound Python launching kernels, one rank per GPU, with idle cores beside it:
an async save's background thread then costs training nothing in CPU, only in the GIL
(and memory bandwidth), since the Python it runs (DCP's planning, the writing of each
tensor's record, the staging copy's per-tensor calls, the commit) runs only while the
training thread waits. This proxy reproduces that: one gloo rank with
`torch.set_num_threads(1)` (the second core is the background save's), a 12-layer GPT
small enough that its step is mostly Python and dispatch (149 parameters, AdamW: ~600
tensors in the state, as the 12x768 GPT of docs/bench-gpu.md), plus frozen parameters
that bring the checkpoint to a realistic size.

Every mode runs save() at the first of K steps then finalize(), interleaved with K steps
without a save (the baseline) in each repeat; figures are medians. Whole cost = (save() +
K steps + finalize()) - K steps without a save: blocked time, the training thread's
slowdown while the background runs, and the wait at finalize. `background CPU` is the
CPU time of the background write-and-commit thread (the staging thread's not included).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from elastrain.checkpoints.dcp import ShardedCheckpointer
from elastrain.checkpoints.manifest import Manifest
from elastrain.contracts.messages import CheckpointCommitted
from elastrain.workers.workloads.gpt import GPT, lm_loss

MB = 1024 * 1024
VOCAB = 65

# mode -> (async_save, template_records)
MODES: dict[str, tuple[bool, bool]] = {
    "sync": (False, True),
    "async": (True, True),
    "async, torch.save per tensor": (True, False),
    "sync, torch.save per tensor": (False, False),
}


class _TimedCheckpointer(ShardedCheckpointer):
    """Records the CPU time of each write-and-commit (the background thread's, when async)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.write_cpu: list[float] = []

    def _write_and_commit(
        self, path: Path, manifest: Manifest, state: Any, extra: bytes | None
    ) -> CheckpointCommitted | None:
        started = time.thread_time()
        try:
            return super()._write_and_commit(path, manifest, state, extra)
        finally:
            self.write_cpu.append(time.thread_time() - started)


def build(frozen_mb: int, frozen_tensors: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, seq_len=64, n_layer=12, n_embd=64, n_head=4)
    per = frozen_mb * MB // 4 // max(frozen_tensors, 1)
    for i in range(frozen_tensors):
        model.register_parameter(f"frozen{i}", nn.Parameter(torch.randn(per), requires_grad=False))
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-4)


def body(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank (a gloo group of 1): the measurements, in the spawned process."""
    torch.set_num_threads(1)
    model, optim = build(cfg["frozen_mb"], cfg["frozen_tensors"])
    work = Path(cfg["dir"])
    steps_after = cfg["steps"]

    def step(ckpt: ShardedCheckpointer | None = None) -> float:
        x = torch.randint(0, VOCAB, (8, 65))
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        waited = ckpt.wait_staged() if ckpt is not None else 0.0
        optim.step()
        optim.zero_grad()
        return waited

    def state() -> dict[str, Any]:
        m, o = get_state_dict(model, optim)
        return {"model": m, "optim": o}

    for _ in range(3):
        step()
    first = state()
    tensors = len(first["model"]) + sum(len(v) for v in first["optim"]["state"].values())
    del first
    ckpts = {
        mode: _TimedCheckpointer(
            work / str(i),
            rank=rank,
            world_size=world_size,
            async_save=is_async,
            async_staging=is_async,
            template_records=templates,
        )
        for i, (mode, (is_async, templates)) in enumerate(MODES.items())
    }
    results: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        results.setdefault(key, []).append(value)

    saved = 0
    total_bytes = 0
    for _ in range(cfg["repeats"] + 1):  # the first round warms every mode up, unrecorded
        warm = saved == 0
        started = time.perf_counter()
        for _ in range(steps_after):
            step()
        if not warm:
            record("baseline", time.perf_counter() - started)
        for i, (mode, ckpt) in enumerate(ckpts.items()):
            saved += 1
            started = time.perf_counter()
            blocked = ckpt.save(step=saved, attempt=0, state=state(), manifest_fields={})
            for _ in range(steps_after):
                blocked += step(ckpt)
            window = time.perf_counter() - started
            started = time.perf_counter()
            commits = ckpt.finalize()
            tail = time.perf_counter() - started
            if commits:
                total_bytes = commits[0].bytes
            if not warm:
                record(f"{mode}.blocked", blocked)
                record(f"{mode}.whole", window + tail)  # less the baseline, in render
                record(f"{mode}.tail", tail)
                record(f"{mode}.cpu", ckpt.write_cpu[-1])
            for old in (work / str(i)).glob("step_*"):
                if old.name != f"step_{saved:09d}-a0":
                    shutil.rmtree(old)
    for ckpt in ckpts.values():
        ckpt.close()
    return {"results": results, "tensors": tensors, "bytes": total_bytes}


def render(cfg: dict[str, Any], out: dict[str, Any]) -> str:
    r = {k: statistics.median(v) for k, v in out["results"].items()}
    base = r["baseline"]
    steps = cfg["steps"]

    def whole(mode: str) -> float:
        return r[f"{mode}.whole"] - base

    ratio = whole("async") / whole("sync")
    ratio_old = whole("async, torch.save per tensor") / whole("sync, torch.save per tensor")
    lines = [
        "## One rank with a spare core (the GPU host's regime, on CPU)",
        "",
        f"`{cfg['command']}`: one gloo rank, `torch.set_num_threads(1)` on "
        f"{os.cpu_count()} cores (torch {torch.__version__}): 12-layer GPT (n_embd 64, "
        f"149 parameters, AdamW) + {cfg['frozen_tensors']} frozen parameters: "
        f"{out['tensors']} tensors, checkpoint of {out['bytes'] / MB:.0f} MB. "
        f"{steps} steps without a save take {base:.3f} s. Medians of {cfg['repeats']} "
        "interleaved repeats. Load average (1, 5, 15 min) at the start "
        f"{_fmt(cfg['load_before'])}, at the end {_fmt(cfg['load_after'])}.",
        "",
        "| | sync | async | async, torch.save per tensor (before) "
        "| sync, torch.save per tensor (before) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    modes = ("sync", "async", "async, torch.save per tensor", "sync, torch.save per tensor")
    rows = (
        ("blocked: in save() + waiting for the staging copy (s)", "blocked", r),
        ("still waiting at finalize() (s)", "tail", r),
        ("CPU of the write and commit (s)", "cpu", r),
    )
    for label, key, table in rows:
        cells = " | ".join(f"{table[f'{m}.{key}']:.3f}" for m in modes)
        lines.append(f"| {label} | {cells} |")
    cells = " | ".join(f"**{whole(m):.3f}**" for m in modes)
    lines.append(
        f"| **whole cost: save() + {steps} steps + finalize() - {steps} steps (s)** | {cells} |"
    )
    lines += [
        "",
        f"Async whole cost / sync whole cost: **{ratio:.2f}** with template records, "
        f"{ratio_old:.2f} with torch.save per tensor (target on the GPU host: <= 0.05).",
        "",
    ]
    return "\n".join(lines)


def _fmt(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)
