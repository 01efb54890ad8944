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
without a save (the baseline) in each repeat, each repeat starting at the next mode;
figures are medians. Whole cost = (save() +
K steps + finalize()) - K steps without a save: blocked time, the training thread's
slowdown while the background runs, and the wait at finalize. On a shared machine that
wall time mixes CPU contention with GIL waits, so the training thread's time is split
(`TrainingClock`, Linux schedstat): on a CPU, runnable but not running, asleep inside the
save's own blocking calls, and asleep elsewhere: the GIL wait, what a GPU host with idle
cores pays too. Background CPU: the write-and-commit thread's, and all other threads'
(the stager's, gloo's); garbage-collection time by thread.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from elastrain.checkpoints.dcp import ShardedCheckpointer
from elastrain.contracts.messages import CheckpointCommitted
from elastrain.workers.workloads.gpt import GPT, lm_loss

MB = 1024 * 1024
VOCAB = 65

# mode -> the checkpointer's arguments; cfg["modes"] picks some (all by default)
MODES: dict[str, dict[str, Any]] = {
    "sync": {"async_save": False},
    "sync, plans every save": {"async_save": False, "keep_plans": False},
    "async": {"async_save": True, "async_staging": True},
    # before 2026-11-28's kept plans: DCP plans every save from scratch (`save_plans`)
    "async, plans every save": {"async_save": True, "async_staging": True, "keep_plans": False},
    # round 1: DCP's collectives even in a group of one (pickled plans and results)
    "async, collectives": {"async_save": True, "async_staging": True, "collectives": True},
    "async, collectives, torch.save per tensor": {
        "async_save": True,
        "async_staging": True,
        "collectives": True,
        "template_records": False,
    },
}


def schedstat(tid: int) -> tuple[int, int]:
    """(ns on a CPU, ns runnable on a run queue but not running) of thread `tid` of this
    process, from Linux's /proc/self/task/<tid>/schedstat; (0, 0) once it has exited."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            on_cpu, queued, _slices = f.read().split()
    except FileNotFoundError:
        return 0, 0
    return int(on_cpu), int(queued)


def thread_ids() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


class TrainingClock:
    """Splits the training thread's wall time into on-CPU, run-queue wait (CPU contention:
    runnable, not running) and the rest, off-CPU sleep. In a loop that does no I/O and (one
    rank) no collectives, that sleep outside the save's own blocking calls is waiting for
    the GIL. `inside` times those blocking calls (save(), wait_staged(), finalize()):
    their sleep is blocking, counted apart."""

    def __init__(self) -> None:
        self.tid = threading.get_native_id()
        self.reset()

    def reset(self) -> None:
        self.wall = 0.0
        self.on_cpu = 0
        self.queued = 0
        self.inside_sleep = 0.0
        self._started = (time.perf_counter(), *schedstat(self.tid))

    def stop(self) -> dict[str, float]:
        t, cpu, queued = time.perf_counter(), *schedstat(self.tid)
        t0, cpu0, queued0 = self._started
        wall, on_cpu, rq = t - t0, (cpu - cpu0) / 1e9, (queued - queued0) / 1e9
        return {
            "wall": wall,
            "on_cpu": on_cpu,
            "runqueue": rq,
            "sleep": wall - on_cpu - rq - self.inside_sleep,
            "blocked_sleep": self.inside_sleep,
        }

    def inside(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t, cpu, queued = time.perf_counter(), *schedstat(self.tid)
        try:
            return call(*args, **kwargs)
        finally:
            t1, cpu1, queued1 = time.perf_counter(), *schedstat(self.tid)
            self.inside_sleep += (t1 - t) - (cpu1 - cpu) / 1e9 - (queued1 - queued) / 1e9


class GcClock:
    """Seconds spent in garbage collections, by whether the training thread ran them (a
    collection runs in whichever thread's allocation triggers it, holding the GIL)."""

    def __init__(self, training_tid: int) -> None:
        self.training_tid = training_tid
        self.seconds = {"training": 0.0, "others": 0.0}
        self._started: dict[int, float] = {}
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        tid = threading.get_native_id()
        if phase == "start":
            self._started[tid] = time.perf_counter()
        elif tid in self._started:
            who = "training" if tid == self.training_tid else "others"
            self.seconds[who] += time.perf_counter() - self._started.pop(tid)

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds = {"training": 0.0, "others": 0.0}
        return out


def others_cpu(exclude: int) -> dict[int, int]:
    """ns on CPU of every thread of this process but `exclude` (the training thread)."""
    return {tid: schedstat(tid)[0] for tid in thread_ids() if tid != exclude}


class _TimedCheckpointer(ShardedCheckpointer):
    """Records the CPU time of each write-and-commit (the background thread's, when async)."""

    def __init__(self, *args: Any, collectives: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.write_cpu: list[float] = []
        if collectives:  # the "before" of a group of one (checkpointer.py, _save_alone)
            self._save_alone = False

    def _write_and_commit(self, *args: Any, **kwargs: Any) -> CheckpointCommitted | None:
        # Whatever the checkpointer passes on (its arguments grow with its save paths).
        started = time.thread_time()
        try:
            return super()._write_and_commit(*args, **kwargs)
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

    clock = TrainingClock()
    gc_clock = GcClock(clock.tid)

    def step(ckpt: ShardedCheckpointer | None = None) -> float:
        x = torch.randint(0, VOCAB, (8, 65))
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        waited = clock.inside(ckpt.wait_staged) if ckpt is not None else 0.0
        optim.step()
        optim.zero_grad()
        return float(waited)

    def state() -> dict[str, Any]:
        m, o = get_state_dict(model, optim)
        return {"model": m, "optim": o}

    for _ in range(3):
        step()
    first = state()
    tensors = len(first["model"]) + sum(len(v) for v in first["optim"]["state"].values())
    del first
    ckpts = {
        mode: _TimedCheckpointer(work / str(i), rank=rank, world_size=world_size, **MODES[mode])
        for i, mode in enumerate(cfg.get("modes") or MODES)
    }
    results: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        results.setdefault(key, []).append(value)

    saved = 0
    total_bytes = 0
    modes = list(enumerate(ckpts.items()))
    for repeat in range(cfg["repeats"] + 1):  # the first round warms every mode up, unrecorded
        warm = saved == 0
        clock.reset()
        gc_clock.take()
        for _ in range(steps_after):
            step()
        if not warm:
            for key, value in clock.stop().items():
                record(f"baseline.{key}", value)
            for who, value in gc_clock.take().items():
                record(f"baseline.gc_{who}", value)
        # Each repeat starts at the next mode: a mode measured right after another
        # async save measured differently from the same mode first (by up to 0.1 s of
        # the training thread's CPU, 2026-11-28), so every mode takes every place in turn.
        turn = repeat % len(modes)
        for i, (mode, ckpt) in modes[turn:] + modes[:turn]:
            saved += 1
            before = others_cpu(clock.tid)
            clock.reset()
            gc_clock.take()
            blocked = clock.inside(
                ckpt.save, step=saved, attempt=0, state=state(), manifest_fields={}
            )
            for _ in range(steps_after):
                blocked += step(ckpt)
            started = time.perf_counter()
            commits = clock.inside(ckpt.finalize)
            tail = time.perf_counter() - started
            split = clock.stop()
            after = others_cpu(clock.tid)
            if commits:
                total_bytes = commits[0].bytes
            if not warm:
                record(f"{mode}.blocked", blocked)
                for key, value in split.items():  # less the baseline's, in render
                    record(f"{mode}.{key}", value)
                for who, value in gc_clock.take().items():
                    record(f"{mode}.gc_{who}", value)
                record(f"{mode}.tail", tail)
                record(f"{mode}.cpu", ckpt.write_cpu[-1])
                others = sum(ns - before.get(tid, 0) for tid, ns in after.items()) / 1e9
                record(f"{mode}.others_cpu", others)
            for old in (work / str(i)).glob("step_*"):
                if old.name != f"step_{saved:09d}-a0":
                    shutil.rmtree(old)
    for ckpt in ckpts.values():
        ckpt.close()
    return {"results": results, "tensors": tensors, "bytes": total_bytes}


def render(cfg: dict[str, Any], out: dict[str, Any]) -> str:
    r = {k: statistics.median(v) for k, v in out["results"].items()}
    steps = cfg["steps"]
    modes = [m for m in MODES if f"{m}.wall" in r]

    def extra(mode: str, key: str) -> float:
        return r[f"{mode}.{key}"] - r[f"baseline.{key}"]

    lines = [
        "## One rank with a spare core (the GPU host's regime, on CPU)",
        "",
        f"`{cfg['command']}`: one gloo rank, `torch.set_num_threads(1)` on "
        f"{os.cpu_count()} cores (torch {torch.__version__}): 12-layer GPT (n_embd 64, "
        f"149 parameters, AdamW) + {cfg['frozen_tensors']} frozen parameters: "
        f"{out['tensors']} tensors, checkpoint of {out['bytes'] / MB:.0f} MB. "
        f"{steps} steps without a save take {r['baseline.wall']:.3f} s: "
        f"{r['baseline.on_cpu']:.3f} s on a CPU, {r['baseline.runqueue']:.3f} s runnable "
        f"but not running, {r['baseline.sleep']:.3f} s asleep. Medians of "
        f"{cfg['repeats']} interleaved repeats. Load average (1, 5, 15 min) at the start "
        f"{_fmt(cfg['load_before'])}, at the end {_fmt(cfg['load_after'])}.",
        "",
        "| | " + " | ".join(modes) + " |",
        "| --- |" + " ---: |" * len(modes),
    ]

    def row(label: str, value: Callable[[str], float], bold: bool = False) -> None:
        cells = " | ".join((f"**{value(m):.3f}**" if bold else f"{value(m):.3f}") for m in modes)
        lines.append(f"| {label} | {cells} |")

    row("blocked: in save() + waiting for the staging copy (s)", lambda m: r[f"{m}.blocked"])
    row("still waiting at finalize() (s)", lambda m: r[f"{m}.tail"])
    row(
        f"**whole cost**: save() + {steps} steps + finalize() - {steps} steps (s)",
        lambda m: extra(m, "wall"),
        bold=True,
    )
    row("training thread: extra time on a CPU (s)", lambda m: extra(m, "on_cpu"))
    row(
        "training thread: extra time runnable, not running (CPU contention) (s)",
        lambda m: extra(m, "runqueue"),
    )
    row(
        "training thread: asleep in save() / wait_staged() / finalize() (s)",
        lambda m: r[f"{m}.blocked_sleep"],
    )
    row(
        "**GIL wait**: training thread asleep elsewhere, less the baseline's (s)",
        lambda m: extra(m, "sleep"),
        bold=True,
    )
    row(
        "garbage collections run by the training thread, extra (s)",
        lambda m: extra(m, "gc_training"),
    )
    row("garbage collections run by the other threads (s)", lambda m: r[f"{m}.gc_others"])
    row("CPU of the write and commit (s)", lambda m: r[f"{m}.cpu"])
    row(
        "CPU of the process's other threads (staging, the write, gloo) (s)",
        lambda m: r[f"{m}.others_cpu"],
    )
    lines.append("")
    if "async" in modes and "sync" in modes:
        lines += [
            f"Async whole cost / sync whole cost: **{extra('async', 'wall') / extra('sync', 'wall'):.2f}** "
            "(target on the GPU host: <= 0.05).",
            "",
        ]
    return "\n".join(lines)


def _fmt(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)
