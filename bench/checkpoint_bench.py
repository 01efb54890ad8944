"""Checkpoint cost on CPU/gloo: training stall of sync vs async saves, and save/load
throughput against plain sequential file I/O of the same bytes (issue 14 part 2, issue 25
item 5).

    .venv/bin/python bench/checkpoint_bench.py [--quick] [--strategy fsdp|ddp] [--only ...]

A second report (`--only gil`, run after the first by default): one rank with a spare core,
the GPU host's regime, where an async save's cost is the GIL (bench/checkpoint_gil.py).
A third (`--only plans`, after the second): N ranks' sync saves with kept save plans and
without DCP's exchanges, against DCP's planning at every save (bench/checkpoint_plans.py).

Two gloo ranks (spawned), a stack of nn.Linear layers + AdamW state of ~400 MB in total
(`--quick`: ~60 MB, 3 repeats). Every figure is the median of `--repeats` runs, and every
per-rank time is the max over ranks (collectives make the slowest rank everyone's time).
Writes the report into its block of docs/bench-checkpoint.md (the notes around it stay).

Columns: sync and async saves with direct I/O, the same through the page cache, and (FSDP)
the same written from peer memory's copy in a job whose peer memory is refreshed after
every step (the ranks as on two nodes; their baseline refreshes too). `--strategy ddp`
saves as the loop saves a DDP job's (each rank stages the items it writes alone) and has
no peer-memory columns (DDP keeps none).

Definitions:
- blocked: seconds the training loop waited for the checkpointer: in save() (sync: DCP
  write with fsync, digest taken while writing, manifest) plus, for async saves with
  overlapped staging, `wait_staged()` before the next optimizer step (as every strategy's
  `step` does) until the staging copy is made.
- extra: how much longer the K steps right after save() took than K steps without a save,
  less the staging wait counted in blocked (the background copy, write and hashing
  competing with training for CPU and memory bandwidth).
- tail: seconds finalize() still waited after those K steps (a sync save has none).
- whole cost (total stall) = blocked + extra + tail: how much longer save() + K steps +
  finalize() took than K steps without a save, i.e. the slowdown of the training loop
  that one checkpoint causes, CPU taken by the background write included. Also estimated
  as blocked + the CPU time of the process's other threads over the same window (less
  the baseline's), which the shared machine's run-queue noise moves less than wall
  time (a lower estimate: the cache and memory bandwidth the save takes are not in it).
- verified load: `load_latest` from a cold page cache, digests checked (XXH3-128, the
  default; and a checkpoint saved with `digest="sha256"`), against a plain sequential
  read of the same files (each rank its own shard, the file its load reads), both ranks
  at once, also cold. (A file of one random chunk written over and over reads back at
  about twice the speed of the shard on this VM, whose disk the host caches: the
  baseline must be the same bytes.)
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from bench import checkpoint_gil, checkpoint_plans  # noqa: E402
from bench.report_blocks import write_block  # noqa: E402
from elastrain.checkpoints.dcp import ShardedCheckpointer  # noqa: E402
from elastrain.checkpoints.dcp.own_items import OwnItemsStager  # noqa: E402
from elastrain.checkpoints.dcp.staging import (  # noqa: E402
    AlignedStateDictStager,
    LayoutStager,
)
from elastrain.workers.api import TrainContext  # noqa: E402
from elastrain.workers.checkpointing import IN_PLACE_MAX_WRITE_STEPS  # noqa: E402
from elastrain.workers.memory.pacing import RefreshPacer  # noqa: E402
from elastrain.workers.memory.snapshots import PeerRefresher, Snapshot  # noqa: E402
from tests.unit.dist_utils import run_distributed  # noqa: E402

MB = 1024 * 1024
CHUNK = 8 * MB
STEPS_AFTER_SAVE = 5
#: The saves the stall section compares, in its columns' order: each with direct I/O
#: (the default) and through the page cache (ELASTRAIN_CHECKPOINT_DIRECT_IO=0); and in a
#: job whose peer memory is refreshed every step (the ranks on two "nodes"), written from
#: the refresh's copy of the checkpoint's step. `async-dcp`: the async save as it was
#: before 2026-11-28, DCP planning and exchanging plans, results and metadata every save.
MODES = (
    "sync", "async", "async-dcp", "async-live", "sync-peer", "async-peer", "sync-cache",
    "async-cache",
)  # fmt: skip
MODE_TITLES = {
    "sync": "sync save",
    "async": "async save (threads, overlapped staging)",
    "async-dcp": "the same, DCP's planning and exchanges at every save",
    "async-live": "async, in place (live tensors written; the update copies what is left)",
    "sync-peer": "sync, from peer memory's copy",
    "async-peer": "async, from peer memory's copy",
    "sync-cache": "sync, page cache",
    "async-cache": "async, page cache",
}


def peer_mode(mode: str) -> bool:
    return mode.endswith("-peer")


def modes_for(strategy: str) -> tuple[str, ...]:
    """DDP keeps no peer memory (every survivor holds the whole state): no such columns."""
    return MODES if strategy != "ddp" else tuple(m for m in MODES if not peer_mode(m))


def build(strategy: str, width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    if strategy == "fsdp":
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = DDP(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    width: int,
    ckpt: ShardedCheckpointer | None = None,
) -> float:
    """One step; returns the seconds waited for an async save's staging copy (before the
    optimizer step, as a strategy's `step` waits)."""
    x = torch.randn(8, width)
    optim.zero_grad()
    F.mse_loss(model(x), x).backward()
    waited = ckpt.wait_staged() if ckpt is not None else 0.0
    optim.step()
    return waited


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class SaveThreadsClock:
    """CPU seconds the checkpointer's background threads spent on saves (the staging copy
    in the stager's thread, the write and commit in the save's thread), each taken with
    `time.thread_time()` inside the thread itself. Work done on the training thread (a
    sync save's) is in its blocked time instead."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds = 0.0

    def install(self) -> None:
        for owner, name in (
            (ShardedCheckpointer, "_write_and_commit"),
            (LayoutStager, "_copy"),
            (OwnItemsStager, "_copy"),  # a DDP rank's staging copy
        ):
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is threading.main_thread():
                return method(*args, **kwargs)
            started = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds += time.thread_time() - started

        return timed


class PeerMemory:
    """Peer memory as a job on two nodes keeps it (`elastrain.workers.memory.snapshots`):
    every rank's shard copied to host memory and sent to the other rank, here after every
    step of the modes that use it (and of their baseline)."""

    def __init__(
        self, rank: int, world_size: int, work: Path, state: Callable[[], dict[str, Any]]
    ) -> None:
        ctx = TrainContext(rank=rank, world_size=world_size, local_rank=rank, job_id=0,
                           attempt=0, device=torch.device("cpu"), checkpoint_root=work)  # fmt: skip
        self._refresher = PeerRefresher(
            ctx=ctx,
            group=dist.new_group(backend="gloo"),
            buddy=(rank + 1) % world_size,
            wards=[(rank - 1) % world_size],
            pacer=RefreshPacer(fixed=1),
        )
        self._strategy = SimpleNamespace(full_replica=False, state_dict_for_checkpoint=state)
        self._copies: list[Snapshot] = []
        self._step = 0

    def refresh(self, step: int | None = None) -> Snapshot:
        self._step = step if step is not None else self._step + 1
        return self._refresher.refresh(self._copies, self._strategy, self._step)  # type: ignore[arg-type]


def drop_cache(path: Path) -> None:
    """Evict one folder's (or file's) pages from the page cache so reads hit the disk;
    per file, so other users of the machine are not affected."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_write(path: Path, data: bytes) -> float:
    """Write `data` (random: bytes the host's disk cache has not seen) + fsync."""
    view = memoryview(data)
    dist.barrier()
    started = time.perf_counter()
    with open(path, "wb") as f:
        for at in range(0, len(data), CHUNK):
            f.write(view[at : at + CHUNK])
        f.flush()
        os.fsync(f.fileno())
    return max_over_ranks(time.perf_counter() - started)


def plain_read(paths: list[Path]) -> float:
    """Read files sequentially from a cold page cache (each rank the files its load reads,
    every rank at once)."""
    for path in paths:
        drop_cache(path)
    buf = bytearray(CHUNK)
    dist.barrier()
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return max_over_ranks(time.perf_counter() - started)


def bench_body(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    width, layers, repeats = cfg["width"], cfg["layers"], cfg["repeats"]
    work = Path(cfg["dir"])
    model, optim = build(cfg["strategy"], width, layers)
    for _ in range(3):  # warm up, and create the optimizer state
        train_step(model, optim, width)

    def state() -> dict[str, Any]:
        m, o = get_state_dict(model, optim)
        return {"model": m, "optim": o}

    peers = PeerMemory(rank, world_size, work, state)

    def steps(n: int, ckpt: ShardedCheckpointer | None = None, *, refresh: bool = False) -> float:
        waited = 0.0
        for _ in range(n):
            waited += train_step(model, optim, width, ckpt)
            if refresh:
                peers.refresh()
        return waited

    results: dict[str, list[float]] = {}
    clock = SaveThreadsClock()
    clock.install()

    def record(key: str, value: float) -> None:
        results.setdefault(key, []).append(value)

    checkpointers = {
        mode: ShardedCheckpointer(
            work / mode,
            rank=rank,
            world_size=world_size,
            async_save=mode.startswith("async"),
            async_staging=mode.startswith("async"),
            direct_io=not mode.endswith("-cache"),
            keep_plans=mode != "async-dcp",
        )
        for mode in modes_for(cfg["strategy"])
    }
    sha256 = ShardedCheckpointer(
        work / "sha256", rank=rank, world_size=world_size, async_save=False, digest="sha256"
    )
    step = 0
    total_bytes = 0
    modes = list(checkpointers.items())
    for repeat in range(repeats):
        # Baseline and every mode interleaved, so slow drift on a shared machine hits all.
        baselines = [("baseline", False)]
        if any(peer_mode(m) for m in checkpointers):
            baselines.append(("baseline-peer", True))
        for key, refresh in baselines:
            dist.barrier()
            started = time.perf_counter()
            steps(STEPS_AFTER_SAVE, refresh=refresh)
            record(key, max_over_ranks(time.perf_counter() - started))
        # Each repeat starts at the next mode, the same on every rank: a mode measured
        # right after another save can pay for it (the GIL proxy's modes did, by up to
        # 0.1 s; a column here read 2-3x its neighbours' CPU in one run and not the next).
        turn = repeat % len(modes)
        for mode, ckpt in modes[turn:] + modes[:turn]:
            step += 1
            fields = {"strategy": cfg["strategy"], "world_size": world_size}
            # The refresh after the step being saved (the baseline's steps refresh too).
            copy = peers.refresh(step).lend(rank) if peer_mode(mode) else None
            dist.barrier()
            started, cpu = time.perf_counter(), clock.seconds
            blocked = ckpt.save(
                step=step,
                attempt=0,
                state=state(),
                manifest_fields=fields,
                copy=copy,
                replicated=cfg["strategy"] == "ddp",  # as the loop saves a DDP job's
                in_place=mode == "async-live",
            )
            blocked += steps(STEPS_AFTER_SAVE, ckpt, refresh=peer_mode(mode))
            window = time.perf_counter() - started
            started = time.perf_counter()
            commits = ckpt.finalize()
            tail = time.perf_counter() - started
            record(f"{mode}.cpu", max_over_ranks(clock.seconds - cpu))
            record(f"{mode}.blocked", max_over_ranks(blocked))
            # save() + K steps, wall time: includes the other ranks waiting in collectives
            # for rank 0's hashing, which per-rank blocked time alone would miss.
            record(f"{mode}.window", max_over_ranks(window))
            record(f"{mode}.tail", max_over_ranks(tail))
            if ckpt.last_tensor_write_s is not None:
                record(f"{mode}.write", max_over_ranks(ckpt.last_tensor_write_s))
            if mode == "async-live":  # copied at the update: not yet written by then
                record(f"{mode}.taken_back", max_over_ranks(ckpt.last_taken_back_bytes))
            if commits:
                total_bytes = commits[0].bytes
            if rank == 0:  # keep the disk footprint to one checkpoint per mode
                for old in (work / mode).glob("step_*-a0"):
                    if old.name != f"step_{step:09d}-a0":
                        shutil.rmtree(old)
            dist.barrier()

    # Throughput: a sync save end to end against plain file I/O of the same bytes.
    random_bytes: bytes | None = None
    # The staging copy an async save makes, by the checkpointer's stager (bytes only once
    # it has seen the state's layout) and by DCP's per-tensor deep copy (what it used
    # before), each into buffers it keeps from the first copy.
    layout_stager, dcp_stager = LayoutStager(device_copies=False), AlignedStateDictStager()
    stagers = {"stage.layout": layout_stager._copy, "stage.dcp": dcp_stager.stage}
    for copy_state in stagers.values():
        copy_state(state())
    for _ in range(repeats):
        for key, copy_state in stagers.items():
            live = state()
            dist.barrier()
            started = time.thread_time()
            copy_state(live)
            record(key, max_over_ranks(time.thread_time() - started))
        step += 1
        ckpt = checkpointers["sync"]
        dist.barrier()
        started = time.perf_counter()
        ckpt.save(step=step, attempt=0, state=state(), manifest_fields={})
        record("save.commit", max_over_ranks(time.perf_counter() - started))
        folder = work / "sync" / f"step_{step:09d}-a0"

        sha256.save(step=step, attempt=0, state=state(), manifest_fields={})
        sha256_folder = work / "sha256" / f"step_{step:09d}-a0"

        for key, loader, verify in (
            ("load.verify", ckpt, True),
            ("load.noverify", ckpt, False),
            ("load.sha256", sha256, True),
        ):
            loader.verify_digests = verify
            if rank == 0:
                drop_cache(sha256_folder if loader is sha256 else folder)
            dist.barrier()
            started = time.perf_counter()
            outcome = loader.load_latest(state())
            assert outcome is not None and outcome.info.step == step
            record(key, max_over_ranks(time.perf_counter() - started))
        ckpt.verify_digests = True

        plain = work / f"plain_{rank}.bin"
        if random_bytes is None:  # made once, outside the timing
            random_bytes = os.urandom(total_bytes // world_size)
        record("plain.write", plain_write(plain, random_bytes))
        plain.unlink()
        # The baseline of the verified load: the same files, read plainly. At the same
        # world size a sharded rank's load reads its own shard (and the small .metadata);
        # a DDP rank's reads every shard (its state is the whole replica), its own first.
        own = folder / f"__{rank}_0.distcp"
        shards = [own]
        if cfg["strategy"] == "ddp":
            shards += sorted(p for p in folder.glob("__*_0.distcp") if p != own)
        record("plain.read", plain_read(shards))
        if rank == 0:
            shutil.rmtree(folder)
            shutil.rmtree(sha256_folder)
        dist.barrier()
    for ckpt in (*checkpointers.values(), sha256):
        ckpt.close()
    layout_stager.close()
    dcp_stager.close()
    if rank != 0:
        return None
    return {"total_bytes": total_bytes, "results": results}


def render(cfg: dict[str, Any], out: dict[str, Any]) -> str:
    r = {k: statistics.median(v) for k, v in out["results"].items()}
    spread = {k: (min(v), max(v)) for k, v in out["results"].items()}
    mb = out["total_bytes"] / MB
    base = r["baseline"]

    def baseline(mode: str) -> float:
        return r["baseline-peer"] if peer_mode(mode) else base

    def stall(mode: str) -> float:
        return r[f"{mode}.window"] - baseline(mode) + r[f"{mode}.tail"]

    def extra(mode: str) -> float:
        return r[f"{mode}.window"] - baseline(mode) - r[f"{mode}.blocked"]

    def cpu_cost(mode: str) -> float:
        return r[f"{mode}.blocked"] + r[f"{mode}.cpu"]

    def row(name: str, cell: Callable[[str], str]) -> str:
        return f"| {name} | " + " | ".join(cell(m) for m in modes_for(cfg["strategy"])) + " |"

    def target(name: str, value: float, goal: str, ok: bool) -> str:
        return f"| {name} | {value:.2f} | {goal} | {'met' if ok else 'not met'} |"

    modes = modes_for(cfg["strategy"])
    peer_rows = (
        [
            "| (both from peer memory's copy of the step, in a job refreshing it every step: "
            "by wall time; by CPU time) "
            f"| {stall('async-peer') / stall('sync-peer'):.2f}; "
            f"{cpu_cost('async-peer') / cpu_cost('sync-peer'):.2f} | | |",
            "| (async from peer memory's copy / the sync save of a job without peer memory: "
            "by wall time; by CPU time) "
            f"| {stall('async-peer') / stall('sync'):.2f}; "
            f"{cpu_cost('async-peer') / cpu_cost('sync'):.2f} | | |",
        ]
        if "async-peer" in modes
        else []
    )
    blocked_ratio = r["async.blocked"] / r["sync.blocked"]
    stall_ratio = stall("async") / stall("sync")
    write_ratio = r["plain.write"] / r["save.commit"]  # throughputs: same bytes
    load_ratio = r["plain.read"] / r["load.verify"]
    sha256_ratio = r["plain.read"] / r["load.sha256"]
    lines = [
        "# Checkpoint benchmark",
        "",
        f"`{cfg['command']}`: "
        f"{cfg['strategy'].upper()}, 2 gloo ranks on CPU "
        f"({os.cpu_count()} cores, torch {torch.__version__}), "
        f"{cfg['layers']} x Linear({cfg['width']}, {cfg['width']}) + AdamW: "
        f"checkpoint of {mb:.0f} MB. Medians of {cfg['repeats']} interleaved runs "
        "(the baseline and each kind of save alternate, each run starting at the next kind; "
        "so do save, load and plain I/O); each time is the max over ranks. Load average (1, 5, 15 min) at the start "
        f"{fmt_load(cfg['load_before'])}, at the end {fmt_load(cfg['load_after'])}.",
        f"{STEPS_AFTER_SAVE} training steps without a save take {base:.3f} s"
        + (
            f" ({r['baseline-peer']:.3f} s refreshing peer memory after each: the baseline "
            "of the peer-memory columns, whose saves are written from the copy of the "
            "refresh before them)"
            if peer_rows
            else " (a DDP rank's async save stages the items it writes alone)"
        )
        + f"; total stall = (save() + the next {STEPS_AFTER_SAVE} steps) - "
        f"those {STEPS_AFTER_SAVE} steps without a save + the wait at finalize().",
        "",
        "## Targets (issue 14 part 2; issue 25 item 5)",
        "",
        "| ratio | measured | target | |",
        "| --- | ---: | ---: | --- |",
        target("async blocked / sync blocked", blocked_ratio, "<= 0.05", blocked_ratio <= 0.05),
        target("async total stall / sync total stall", stall_ratio, "<= 0.50", stall_ratio <= 0.5),
        "| (the same, estimated from CPU time: async blocked + CPU / sync blocked + CPU) "
        f"| {cpu_cost('async') / cpu_cost('sync'):.2f} | | |",
        "| (the same, with DCP's planning and exchanges at every save as before 2026-11-28: "
        f"by wall time; by CPU time) | {stall('async-dcp') / stall('sync'):.2f}; "
        f"{cpu_cost('async-dcp') / cpu_cost('sync'):.2f} | | |",
        target(
            "async in place / sync, total stall (a host-memory state unless its tensors "
            "take over a step to write, the loop's choice)",
            stall("async-live") / stall("sync"),
            "<= 0.50",
            stall("async-live") / stall("sync") <= 0.5,
        ),
        "| (the same, estimated from CPU time) "
        f"| {cpu_cost('async-live') / cpu_cost('sync'):.2f} | | |",
        # What `writes_in_place` compares: the loop writes in place only when this holds.
        f"| (its tensors written in {r['async-live.write']:.3f} s vs a step "
        f"{IN_PLACE_MAX_WRITE_STEPS * base / STEPS_AFTER_SAVE:.3f} s: the loop would "
        + (
            "write in place"
            if r["async-live.write"] <= IN_PLACE_MAX_WRITE_STEPS * base / STEPS_AFTER_SAVE
            else "stage"
        )
        + "; copied at the update, not yet written by then: "
        f"{r['async-live.taken_back'] / MB:.0f} MB of the ~{mb / 2:.0f} MB a rank writes)"
        " | | | |",
        "| (both through the page cache, no direct I/O: by wall time; by CPU time) "
        f"| {stall('async-cache') / stall('sync-cache'):.2f}; "
        f"{cpu_cost('async-cache') / cpu_cost('sync-cache'):.2f} | | |",
        *peer_rows,
        target(
            "committed save MB/s / plain write + fsync MB/s",
            write_ratio,
            ">= 0.70",
            write_ratio >= 0.7,
        ),
        target("verified load MB/s / plain read MB/s", load_ratio, ">= 0.70", load_ratio >= 0.7),
        f"| (the same, a checkpoint with sha256 digests) | {sha256_ratio:.2f} | | |",
        "",
        "## Training stall per checkpoint",
        "",
        "| | " + " | ".join(MODE_TITLES[m] for m in modes) + " |",
        "| --- |" + " ---: |" * len(modes),
        row(
            "blocked: in save() + waiting for the staging copy (s)",
            lambda m: f"{r[m + '.blocked']:.3f}",
        ),
        row(f"extra time of the next {STEPS_AFTER_SAVE} steps (s)", lambda m: f"{extra(m):+.3f}"),
        row("still waiting at finalize() after them (s)", lambda m: f"{r[m + '.tail']:.3f}"),
        row("**total stall (s)**", lambda m: f"**{stall(m):.3f}**"),
        row(
            "CPU time of the save's background threads: staging copy, write, commit (s)",
            lambda m: f"{r[m + '.cpu']:.3f}",
        ),
        row(
            "**whole cost estimated from CPU: blocked + that (s)**",
            lambda m: f"**{cpu_cost(m):.3f}**",
        ),
        "",
        "The CPU rows: the CPU time the checkpointer's background threads spent on the "
        "save (`time.thread_time()` taken inside each), the most of any rank. With every "
        "core busy training, each CPU-second a background save spends is a second taken "
        "from training, so blocked + that estimates a save's whole cost without the "
        "run-queue noise that moves the steps' wall time by more than a save here (a sync "
        "save's work is all in its blocked time, with its fsync wait). Not in it: the "
        "kernel's own writeback threads, which a save through the page cache keeps busy "
        "after it returns, and gloo's threads.",
        "",
        "## Throughput",
        "",
        "| operation | seconds (median) | min - max | MB/s |",
        "| --- | ---: | ---: | ---: |",
    ]
    rows = [
        (
            "sync save, committed (DCP write + fsync, XXH3-128 while writing, manifest)",
            "save.commit",
        ),
        ("plain sequential write + fsync, as many random bytes, both ranks at once", "plain.write"),
        (
            "async save's staging copy, the layout seen before: bytes only (CPU of the "
            "copying thread)",
            "stage.layout",
        ),
        ("the same by DCP's per-tensor deep copy (the staging before 2026-11-28)", "stage.dcp"),
        ("load_latest, verifying XXH3-128 digests (cold cache)", "load.verify"),
        ("load_latest, verifying sha256 digests (cold cache)", "load.sha256"),
        ("load_latest, sizes only (cold cache)", "load.noverify"),
        (
            "plain sequential read of the shard files each rank's load reads (its own; a DDP "
            "rank's: every one), both ranks at once (cold cache)",
            "plain.read",
        ),
    ]
    for label, key in rows:
        low, high = spread[key]
        lines.append(f"| {label} | {r[key]:.3f} | {low:.3f} - {high:.3f} | {mb / r[key]:.0f} |")
    lines.append("")
    return "\n".join(lines)


def fmt_load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="~60 MB state, 3 repeats")
    parser.add_argument("--strategy", choices=["fsdp", "ddp"], default="fsdp")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: tmp)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-checkpoint.md")
    parser.add_argument(
        "--only",
        choices=["two-ranks", "gil", "plans"],
        default=None,
        help="one of the three reports (default: all)",
    )
    parser.add_argument(
        "--gil-modes",
        default="",
        help="modes of the GIL proxy, separated by ';' (their names hold commas; default: "
        "all; bench/checkpoint_gil.py's MODES)",
    )
    args = parser.parse_args()
    if args.only in (None, "two-ranks"):
        two_ranks(args)
    if args.only in (None, "gil"):
        gil_proxy(args)
    if args.only in (None, "plans"):
        plans(args)


def gil_proxy(args: argparse.Namespace) -> None:
    """One rank, one torch thread, a spare core (bench/checkpoint_gil.py)."""
    frozen_mb, frozen_tensors, steps = (160, 4, 10) if not args.quick else (8, 2, 3)
    scratch = Path(tempfile.mkdtemp(prefix="ckpt-gil-bench-", dir=args.dir))
    cfg = {
        "frozen_mb": frozen_mb,
        "frozen_tensors": frozen_tensors,
        "steps": steps,
        "repeats": args.repeats or (2 if args.quick else 7),
        "modes": [m.strip() for m in args.gil_modes.split(";") if m.strip()],
        "dir": str(scratch),
        **run_facts(),
    }
    try:
        out = run_distributed(checkpoint_gil.body, 1, cfg, timeout_s=3600, pg_timeout_s=600)[0]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    cfg["load_after"] = os.getloadavg()
    publish(args, "checkpoint-gil-report", checkpoint_gil.render(cfg, out))


def plans(args: argparse.Namespace) -> None:
    """N ranks, sync saves: DCP's planning and exchanges against kept plans
    (bench/checkpoint_plans.py)."""
    worlds = (2,) if args.quick else (2, 4)
    scratch = Path(tempfile.mkdtemp(prefix="ckpt-plans-bench-", dir=args.dir))
    cfg: dict[str, Any] = {
        "frozen_mb": 8,
        "repeats": args.repeats or (3 if args.quick else 11),
        "cores": os.cpu_count(),
        **run_facts(),
    }
    runs = {}
    try:
        for world in worlds:
            cfg["dir"] = str(scratch / str(world))
            runs[world] = run_distributed(
                checkpoint_plans.body, world, cfg, timeout_s=3600, pg_timeout_s=600
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    cfg["load_after"] = os.getloadavg()
    publish(args, "checkpoint-plans-report", checkpoint_plans.render(cfg, runs))


def two_ranks(args: argparse.Namespace) -> None:
    """The first report: two gloo ranks on busy cores."""

    # Parameters x 3 (weights, exp_avg, exp_avg_sq) x 4 bytes: 32 x 1024^2 -> ~400 MB.
    width, layers = (1024, 32) if not args.quick else (512, 20)
    repeats = args.repeats or (3 if args.quick else 5)
    scratch = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    cfg = {
        "quick": args.quick,
        "strategy": args.strategy,
        "width": width,
        "layers": layers,
        "repeats": repeats,
        "dir": str(scratch),
        **run_facts(),
    }
    try:
        out = run_distributed(bench_body, 2, cfg, timeout_s=3600, pg_timeout_s=600)[0]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    cfg["load_after"] = os.getloadavg()
    publish(args, "checkpoint-report", render(cfg, out))


def run_facts() -> dict[str, Any]:
    """What every report says of its run: the command and the load when it started."""
    return {
        "command": " ".join([".venv/bin/python", "bench/checkpoint_bench.py", *sys.argv[1:]]),
        "load_before": os.getloadavg(),
    }


def publish(args: argparse.Namespace, block: str, table: str) -> None:
    """Print a report and write it into its own block of `--out`: the notes written
    around it in the same file (what changed, run to run, what is not met) stay."""
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_block(args.out, block, table)


if __name__ == "__main__":
    main()
