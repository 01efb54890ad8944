"""Checkpoint cost on CPU/gloo (issues 14, 25 and 41): the training stall of an async save
against a sync save's, the steps taken while a save writes, DCP's thread against its
process, and the verified load against a plain read of the same files.

    .venv/bin/python bench/checkpoint_bench.py [--quick] [--strategy fsdp|ddp] [--repeats N]
        [--only load]

Two gloo ranks (spawned, one torch thread each), nn.Linear layers + AdamW state of ~400 MB
(`--quick`: ~60 MB, 3 repeats). Figures are medians of `--repeats` runs, in which the
baseline and each kind of save alternate; per-rank times are the max over ranks. The report
goes into the strategy's block of `--out` (docs/bench-checkpoint.md; the notes around stay).

Kinds: `sync`, `async`: `ShardedCheckpointer`, as the loop saves. `thread`, `process`:
`dcp.async_save` called directly (plain `FileSystemWriter`, `DefaultStager`, shared memory
for the process), `AsyncCheckpointerType.THREAD` or `PROCESS`. Each makes one warm-up save
first (the process starts at it: its "first save" time).
- blocked (the stall): what the loop waited before its next update: save() (a sync save:
  write + fsync, digests, commit) + the wait for the staging copy (`wait_staged()`).
- steps while writing: the median time of the steps begun while the save was in flight
  (written or committed), less any staging wait, over the median step with none in flight.
- extra: how much longer the K steps after save() took than K steps without a save, less
  the staging wait; tail: the wait to finish the save after them. Whole cost = blocked +
  extra + tail (the background work taking the cores from training included).
- verified load: `load_latest` (digests checked) against a plain sequential read of the
  files each rank's load reads, both from a cold page cache; beside them `dcp.load` of the
  same folder (DCP's `FileSystemReader`, nothing verified), which says how much of the gap
  is the verifying and how much DCP's own read path. `--only load` measures only
  this (no other kind of save) and prints its figure without writing the report.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import (  # noqa: E402
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from bench.report_blocks import write_block  # noqa: E402
from elastrain.checkpoints.dcp import ShardedCheckpointer  # noqa: E402
from tests.unit.dist_utils import run_distributed  # noqa: E402

MB = 1024 * 1024
CHUNK = 8 * MB
STEPS_AFTER_SAVE = 5
#: How long a save may take to finish before its kind is given up (a PROCESS whose
#: helper never starts must not hang the whole bench).
FINISH_TIMEOUT_S = 300.0
MODES = ("sync", "async", "thread", "process")
TITLES = {
    "sync": "sync save (ShardedCheckpointer)",
    "async": "async save (ShardedCheckpointer: DCP thread)",
    "thread": "dcp.async_save, THREAD",
    "process": "dcp.async_save, PROCESS",
}


def build(strategy: str, width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    if strategy == "ddp":
        return DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-4)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


class ProductSaver(ShardedCheckpointer):
    """A save as the training loop makes it."""

    def put(self, step: int, state: dict[str, Any]) -> float:
        return self.save(step=step, attempt=0, state=state, manifest_fields={})

    def writing(self) -> bool:
        # Private, read only: whether the write (or its commit) is still going on.
        return self._inflight is not None and not self._inflight.done.done()


class DcpSaver:
    """`dcp.async_save` directly, in DCP's thread or its checkpoint process."""

    def __init__(self, root: Path, kind: AsyncCheckpointerType) -> None:
        self.root, self.kind = root, kind
        # Its own group: the background save's collectives beside training's.
        self.group = dist.new_group(backend="gloo")
        process = kind == AsyncCheckpointerType.PROCESS
        # Shared memory for the process: its staged copy is handed over, not pickled.
        options = StagingOptions(False, process, True, False)  # pinned, shared, async, non-blocking
        self.stager = DefaultStager(options)
        self.staged: Future[None] | None = None
        self.done: Future[Any] | None = None

    def put(self, step: int, state: dict[str, Any]) -> float:
        started = time.perf_counter()
        self.finalize()  # as ShardedCheckpointer: one save in flight at a time
        response = dcp.async_save(
            state,
            storage_writer=dcp.FileSystemWriter(self.root / f"step_{step:09d}"),
            process_group=self.group,
            async_checkpointer_type=self.kind,
            async_stager=self.stager,
        )
        assert isinstance(response, AsyncSaveResponse)
        self.staged, self.done = response.staging_completion, response.upload_completion
        return time.perf_counter() - started

    def wait_staged(self) -> float:
        staged, self.staged = self.staged, None
        started = time.perf_counter()
        if staged is not None:
            staged.result(timeout=FINISH_TIMEOUT_S)
        return time.perf_counter() - started

    def writing(self) -> bool:
        return self.done is not None and not self.done.done()

    def finalize(self) -> None:
        done, self.done = self.done, None
        if done is not None:
            done.result(timeout=FINISH_TIMEOUT_S)

    def close(self) -> None:
        self.finalize()
        self.stager.close()


Saver = ProductSaver | DcpSaver


def drop_cache(path: Path) -> None:
    """Evict a folder's (or file's) pages from the page cache, per file (not the machine's)."""
    for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


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
    return time.perf_counter() - started


def prune(root: Path, keep: str) -> None:
    """Keep one checkpoint per kind on disk (rank 0, every save finished)."""
    for old in root.glob("step_*"):
        if not old.name.startswith(keep):
            shutil.rmtree(old)


def bench_body(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    width, layers, repeats = cfg["width"], cfg["layers"], cfg["repeats"]
    work = Path(cfg["dir"])
    model, optim = build(cfg["strategy"], width, layers)
    rec: dict[str, list[Any]] = {}
    errors: dict[str, str] = {}

    def record(key: str, value: Any) -> None:
        rec.setdefault(key, []).append(value)

    def state() -> dict[str, Any]:
        m, o = get_state_dict(model, optim)
        return {"model": m, "optim": o}

    def steps(n: int, saver: Saver | None = None) -> tuple[list[tuple[float, bool]], float]:
        """n steps: each one's (seconds less the staging wait, save in flight at its
        start), and the seconds waited for the staging copy before the first update."""
        out, waited = [], 0.0
        for _ in range(n):
            writing = saver is not None and saver.writing()
            started = time.perf_counter()
            x = torch.randn(8, width)
            optim.zero_grad()
            F.mse_loss(model(x), x).backward()
            wait = saver.wait_staged() if saver is not None else 0.0
            optim.step()
            out.append((time.perf_counter() - started - wait, writing))
            waited += wait
        return out, waited

    steps(3)  # warm up, and create the optimizer state
    savers: dict[str, Saver] = {
        "sync": ProductSaver(work / "sync", rank=rank, world_size=world_size, async_save=False)
    }
    if cfg["only"] != "load":
        savers["async"] = ProductSaver(
            work / "async", rank=rank, world_size=world_size, async_save=True
        )
        savers["thread"] = DcpSaver(work / "thread", AsyncCheckpointerType.THREAD)
        savers["process"] = DcpSaver(work / "process", AsyncCheckpointerType.PROCESS)
    step = 0
    for mode, saver in list(savers.items()):  # warm-up saves (the process starts here)
        step += 1
        dist.barrier()
        started = time.perf_counter()
        try:
            saver.put(step, state())
            saver.wait_staged()
            saver.finalize()
            failed = 0.0
        except Exception as e:  # reported, and that kind left out
            errors[mode] = f"{type(e).__name__}: {e}"
            failed = 1.0
        record(f"{mode}.first", time.perf_counter() - started)
        agreed = torch.tensor([failed])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        if agreed.item():
            errors.setdefault(mode, "failed on another rank")
            del savers[mode]
    modes = list(savers.items())
    for repeat in range(0 if cfg["only"] == "load" else repeats):
        dist.barrier()
        started = time.perf_counter()
        record("baseline.steps", steps(STEPS_AFTER_SAVE)[0])
        record("baseline.window", time.perf_counter() - started)
        turn = repeat % len(modes)
        for mode, saver in modes[turn:] + modes[:turn]:
            step += 1
            live = state()
            dist.barrier()
            started = time.perf_counter()
            blocked = saver.put(step, live)
            taken, waited = steps(STEPS_AFTER_SAVE, saver)
            window = time.perf_counter() - started
            started = time.perf_counter()
            saver.finalize()
            record(f"{mode}.tail", time.perf_counter() - started)
            record(f"{mode}.blocked", blocked + waited)
            record(f"{mode}.window", window)
            record(f"{mode}.steps", taken)
            dist.barrier()
            if rank == 0:
                prune(work / mode, f"step_{step:09d}")

    # Verified load against a plain read of the same files, both from a cold cache.
    sync = savers["sync"]
    assert isinstance(sync, ProductSaver)
    total_bytes = 0
    for _ in range(repeats):
        step += 1
        sync.put(step, state())
        folder = work / "sync" / f"step_{step:09d}-a0"
        # Verified, then DCP's own load of the same folder with nothing verified (which
        # splits the gap to a plain read into what verifying costs and what DCP's read
        # path does), in turns, each from a cold cache.
        loads = ("load.verify", "load.dcp") if len(rec.get("load.dcp", [])) % 2 == 0 else (
            "load.dcp", "load.verify")  # fmt: skip
        for kind in loads:
            if rank == 0:
                drop_cache(folder)
            dist.barrier()
            started = time.perf_counter()
            if kind == "load.verify":
                outcome = sync.load_latest(state())
                assert outcome is not None and outcome.info.step == step
            else:
                dcp.load(state(), checkpoint_id=str(folder))
            record(kind, time.perf_counter() - started)
        # A sharded rank's load reads its own shard; a DDP rank's every shard (its state
        # is the whole replica), its own first.
        own = sorted(folder.glob(f"__{rank}_*.distcp"))
        shards = own + sorted(p for p in folder.glob("__*.distcp") if p not in own)
        shards = shards if cfg["strategy"] == "ddp" else own
        total_bytes = sum(p.stat().st_size for p in folder.glob("__*.distcp"))
        record("plain.read", plain_read(shards))
        dist.barrier()
        if rank == 0:
            prune(work / "sync", f"step_{step:09d}")
    for saver in savers.values():
        saver.close()
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, rec)
    if rank != 0:
        return None
    return {"total_bytes": total_bytes, "results": merge(everyone), "errors": errors}


def merge(per_rank: list[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    """Each value the max over ranks; a run of steps step by step (in flight: on any)."""

    def worst(values: tuple[Any, ...]) -> Any:
        if isinstance(values[0], list):
            return [worst(step) for step in zip(*values, strict=True)]
        if isinstance(values[0], tuple):
            return (max(v[0] for v in values), any(v[1] for v in values))
        return max(values)

    return {k: [worst(v) for v in zip(*(r[k] for r in per_rank), strict=True)] for k in per_rank[0]}


def render(cfg: dict[str, Any], out: dict[str, Any]) -> str:
    res = out["results"]
    modes = [m for m in MODES if f"{m}.blocked" in res]
    r = {k: statistics.median(v) for k, v in res.items() if not k.endswith(".steps")}
    base_step = statistics.median(t for run in res["baseline.steps"] for t, _ in run)

    def writing_steps(mode: str) -> list[float]:
        return [t for run in res[f"{mode}.steps"] for t, busy in run if busy]

    def slowdown(mode: str) -> float | None:
        taken = writing_steps(mode)
        return statistics.median(taken) / base_step if taken else None

    def extra(mode: str) -> float:
        return r[f"{mode}.window"] - r["baseline.window"] - r[f"{mode}.blocked"]

    def whole(mode: str) -> float:
        return r[f"{mode}.window"] - r["baseline.window"] + r[f"{mode}.tail"]

    def stall_pct(mode: str) -> float:
        return 100 * r[f"{mode}.blocked"] / r["sync.blocked"]

    def row(name: str, cell: Callable[[str], str]) -> str:
        return f"| {name} | " + " | ".join(cell(m) for m in modes) + " |"

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    def versus(cell: Callable[[str], str]) -> str:
        return " vs ".join(cell(m) for m in ("thread", "process") if m in modes)

    load = r["plain.read"] / r["load.verify"]
    slow = slowdown("async")
    targets = (
        ("async save's stall (save() + staging wait) / sync save's blocked time",
         f"{stall_pct('async'):.1f} %", "<= 5 %", stall_pct("async") <= 5),
        ("median step while the async save writes / with no save in flight",
         ratio(slow), "<= 1.10x", None if slow is None else slow <= 1.10),
        ("async save's whole cost / sync save's (blocked + extra + tail)",
         f"{whole('async') / whole('sync'):.2f}", "<= 0.50", whole("async") / whole("sync") <= 0.5),
        ("verified load MB/s / plain read MB/s (cold cache)", f"{load:.2f}", ">= 0.70",
         load >= 0.7),
        ("the same for DCP's own load, nothing verified", f"{r['plain.read'] / r['load.dcp']:.2f}",
         "", None),
        ("dcp.async_save THREAD vs PROCESS: stall, % of sync", versus(
            lambda m: f"{stall_pct(m):.1f} %"), "choose", None),
        ("the same: median step while the save writes / none in flight", versus(
            lambda m: ratio(slowdown(m))), "choose", None),
    )  # fmt: skip
    lines = [
        f"## {cfg['strategy'].upper()}",
        "",
        f"`{cfg['command']}`: {cfg['strategy'].upper()}, 2 gloo ranks on CPU "
        f"({os.cpu_count()} cores, torch {torch.__version__}), {cfg['layers']} x "
        f"Linear({cfg['width']}, {cfg['width']}) + AdamW: checkpoint of "
        f"{out['total_bytes'] / MB:.0f} MB. Medians of {cfg['repeats']} interleaved runs; "
        f"each time the max over ranks. Load average (1, 5, 15 min) at the start "
        f"{fmt_load(cfg['load_before'])}, at the end {fmt_load(cfg['load_after'])}. "
        f"A step without a save in flight: {base_step:.3f} s ({STEPS_AFTER_SAVE} take "
        f"{r['baseline.window']:.3f} s).",
        "",
        "| figure | measured | target | |",
        "| --- | ---: | ---: | --- |",
        *(
            f"| {name} | {value} | {goal} | {'' if ok is None else 'met' if ok else 'not met'} |"
            for name, value, goal, ok in targets
        ),
        "",
        "### Per checkpoint",
        "",
        "| | " + " | ".join(TITLES[m] for m in modes) + " |",
        "| --- |" + " ---: |" * len(modes),
        row("blocked: save() + staging wait (s)", lambda m: f"{r[m + '.blocked']:.3f}"),
        row("stall, % of the sync save's", lambda m: f"{stall_pct(m):.1f} %"),
        row(
            "median step while the save writes / with none in flight (steps)",
            lambda m: f"{ratio(slowdown(m))} ({len(writing_steps(m))})",
        ),
        row(f"extra time of the next {STEPS_AFTER_SAVE} steps (s)", lambda m: f"{extra(m):+.3f}"),
        row("still waiting after them (s)", lambda m: f"{r[m + '.tail']:.3f}"),
        row("**whole cost (s)**", lambda m: f"**{whole(m):.3f}**"),
        row("first save, start to finish (s)", lambda m: f"{res[m + '.first'][0]:.2f}"),
        "",
        f"Verified load (`load_latest`, XXH3-128 digests): {r['load.verify']:.3f} s; "
        f"`dcp.load` of the same folder, nothing verified: {r['load.dcp']:.3f} s; a plain "
        f"read of the same shard files: {r['plain.read']:.3f} s.",
    ]
    if "process" in modes and "thread" in modes:
        started = res["process.first"][0] - res["thread.first"][0]
        lines.append(
            f"The first PROCESS save started DCP's checkpoint process: {started:.2f} s more "
            "than the first THREAD save."
        )
    for mode, error in out["errors"].items():
        lines.append(f"**{TITLES[mode]} did not run here**: {error}")
    lines.append("")
    return "\n".join(lines)


def render_load(cfg: dict[str, Any], out: dict[str, Any]) -> str:
    """The verified-load figure alone (`--only load`)."""
    res = out["results"]
    verify, plain = statistics.median(res["load.verify"]), statistics.median(res["plain.read"])
    own = statistics.median(res["load.dcp"])
    return (
        f"{cfg['strategy'].upper()}, checkpoint of {out['total_bytes'] / MB:.0f} MB, medians "
        f"of {cfg['repeats']}: verified load {verify:.3f} s, dcp.load unverified {own:.3f} s, "
        f"plain read {plain:.3f} s; verified load MB/s / plain read MB/s {plain / verify:.2f} "
        f"(target >= 0.70), dcp.load's {plain / own:.2f}; runs "
        f"{', '.join(f'{v:.3f}' for v in res['load.verify'])} s / "
        f"{', '.join(f'{d:.3f}' for d in res['load.dcp'])} s / "
        f"{', '.join(f'{p:.3f}' for p in res['plain.read'])} s"
    )


def fmt_load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="~60 MB state, 3 repeats")
    parser.add_argument("--strategy", choices=["fsdp", "ddp"], default="fsdp")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--only", choices=["load"], default=None, help="measure only the verified load"
    )
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: tmp)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-checkpoint.md")
    args = parser.parse_args()
    # Parameters x 3 (weights, exp_avg, exp_avg_sq) x 4 bytes: 32 x 1024^2 -> ~400 MB.
    width, layers = (1024, 32) if not args.quick else (512, 20)
    scratch = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    cfg = {"strategy": args.strategy, "width": width, "layers": layers, "dir": str(scratch),
           "repeats": args.repeats or (3 if args.quick else 5), "only": args.only, "load_before": os.getloadavg(),
           "command": " ".join([".venv/bin/python", "bench/checkpoint_bench.py", *sys.argv[1:]])}  # fmt: skip
    try:
        out = run_distributed(bench_body, 2, cfg, timeout_s=3600, pg_timeout_s=600)[0]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    cfg["load_after"] = os.getloadavg()
    if args.only == "load":
        print(render_load(cfg, out))
        return
    report = render(cfg, out)
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # Each strategy its own block: FSDP's first, the table bench/all.py records.
    block = "checkpoint-report" if args.strategy == "fsdp" else f"checkpoint-{args.strategy}-report"
    write_block(args.out, block, report)


if __name__ == "__main__":
    main()
