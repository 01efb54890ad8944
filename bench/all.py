"""Every benchmark under `bench/`, alone or all together, in one command.

Each part is its own script (it writes its full report to `docs/bench-<part>.md`, between
markers: the notes written around them stay); this runs the chosen parts one after
another, records the machine, the versions, the load average before and after each part,
its command and its wall time, and writes that run record and each part's headline table
into `docs/benchmarks.md`, each between its own markers (a part run alone replaces its
block only; the status and the analysis written around the blocks stay). It exits non-zero
when a part's script failed, after running the others.

    .venv/bin/python bench/all.py                        # every part (about 45 minutes)
    .venv/bin/python bench/all.py --parts scheduler,metrics
    .venv/bin/python bench/all.py --quick                # small sizes: checks the scripts run

`--quick` is what CI runs (`make bench-quick`, part of `make test`): every script end to
end on small sizes, with few repeats, the baselines included; its reports go to a temp
dir and its numbers are not figures.

The other files under `bench/` are these scripts' helpers, run with them, and
`screenshots.py` (see HELPERS and NOT_BENCHES below).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_blocks import first_table, replace_block  # noqa: E402


@dataclass(frozen=True)
class Part:
    name: str
    title: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]

    @property
    def doc(self) -> Path:
        return ROOT / "docs" / f"bench-{self.name}.md"


PARTS = (
    Part("step-overhead", "1. Step time vs plain torchrun", "step_overhead_bench.py",
         ("--repeats", "5", "--steps", "300"), ("--repeats", "1", "--steps", "20", "--warmup", "5", "--strategies", "ddp")),
    Part("checkpoint", "2. Checkpoint stall, steps while writing, thread vs process, load", "checkpoint_bench.py",
         ("--repeats", "9"), ("--quick",)),
    Part("scheduler", "3. Scheduler pass, 1,000 PENDING + 100 RUNNING", "scheduler_bench.py",
         ("--passes", "20"), ("--pending", "100", "--running", "10", "--passes", "3")),
    Part("control-plane", "3. Submit at 100/s, list and job page at 10,000 jobs + 10M metric rows",
         "control_plane_bench.py", (),
         ("--jobs", "200", "--metric-rows", "20000", "--seconds", "2", "--runs", "1")),
    Part("api", "3. Submit and read throughput at 10,000 jobs", "api_bench.py",
         (), ("--jobs", "200", "--requests", "100", "--runs", "1")),
    Part("metrics", "4. Metrics of a 1,000,000-step job", "metrics_bench.py",
         (), ("--steps", "20000", "--repeats", "3")),
    # Quick: one trial each, Ray Train's worker-group start timeout at 5 s instead of 60 s,
    # which its node-loss recovery waits out, and drains with a 10 s deadline instead of
    # 30 s, most of which its drain waits out (both paths still run, sooner).
    Part("elastic", "Start, node loss, drain and node return vs Ray Train and torchrun",
         "elastic_bench.py", (),
         ("--repeats", "1", "--baseline-repeats", "1", "--ray-train-start-timeout", "5",
          "--drain-deadline", "10")),
    Part("training", "Training throughput per strategy and world size (CPU, gloo)",
         "training_bench.py", (), ("--steps", "8", "--quick")),
    Part("packages", "Shipping a working directory", "package_bench.py",
         (), ("--repeats", "1", "--data-mb", "4")),
    Part("command", "Bring your own script: submit -> first step vs built-in loop and torchrun",
         "command_bench.py", (), ("--quick",)),
    # Needs an NVIDIA GPU (`make gpu-check`); where there is none (CI) it says "no GPU:
    # skipped, nothing measured" and exits 0, leaving docs/bench-gpu.md as it is.
    Part("gpu", "GPU check: bf16 DDP and FSDP2 vs plain torchrun", "gpu_check.py",
         (), ("--quick",)),
    Part("abuse", "Other clients' latency while one client abuses the server",
         "server_abuse_bench.py", (),
         ("--runs", "1", "--seconds", "2", "--warmup", "1", "--jobs", "20", "--header-mb", "8",
          "--half-open", "200")),
    Part("host-overhead", "Ops the step dispatches vs plain torchrun (CPU proxy of a GPU step)",
         "step_host_overhead.py", ("--gate",),
         ("--steps", "3", "--warmup", "1", "--precisions", "fp32", "--gate")),
    Part("peer-restore", "Peer memory: refresh cost, hand-over vs broadcast, node loss per strategy",
         "peer_restore_bench.py", ("--repeats", "5"), ("--quick",)),
    Part("prepare", "elastrain prepare: tokens/s of Ray Data vs one process",
         "prepare_bench.py", (), ("--quick",)),
    # Quick: four faults on one ddp job, to check the campaign runs end to end.
    Part("chaos", "Chaos campaign: recovery per kind of fault, curves vs uninterrupted",
         "chaos_bench.py", ("--faults", "200"),
         ("--faults", "4", "--strategies", "ddp", "--kinds",
          "kill9,node_removed,raylet_kill,preemption")),
    # Quick: one trial with 40-step windows, to check it runs end to end (about a minute).
    Part("stragglers", "Stragglers: a 2x slow rank evicted, throughput after vs the ranks left alone",
         "straggler_bench.py", ("--repeats", "3"), ("--quick",)),
)  # fmt: skip
BY_NAME = {p.name: p for p in PARTS}
#: The other files under bench/: helpers the parts' scripts import or start, and a script
#: that measures nothing (it takes the dashboard's screenshots in docs/). A new script must
#: be one of these or a part (tests/unit/test_bench_all.py checks), so none rots unseen.
HELPERS = frozenset({"all.py", "report_blocks.py", "scratch_db.py", "step_log.py",
                     "plain_torchrun.py", "torchrun_loop.py"})  # fmt: skip
NOT_BENCHES = frozenset({"screenshots.py"})


def versions() -> str:
    names = ("torch", "ray", "fastapi", "sqlalchemy", "psycopg")
    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return f"Python {platform.python_version()}, " + ", ".join(found)


def machine() -> str:
    memory = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f", {kib / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return f"{platform.machine()}, {os.cpu_count()} CPUs{memory}, {platform.system()} {platform.release()}"


def run_part(part: Part, *, quick: bool, out: Path) -> tuple[bool, list[str]]:
    """Run one part's script: did it succeed, and its record (command, load, time,
    outcome, headline table)."""
    args = part.quick if quick else part.full
    argv = [sys.executable, f"bench/{part.script}", *args, "--out", str(out)]
    shown = " ".join(["python", f"bench/{part.script}", *args])
    before, started = os.getloadavg(), time.monotonic()
    print(f"== {part.title}: {shown}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, cwd=ROOT, env=env, check=False)
    seconds, after = time.monotonic() - started, os.getloadavg()
    lines = [
        f"### {part.title}",
        "",
        f"`{shown}` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {seconds:.0f} s, "
        f"load average {before[0]:.1f} before, {after[0]:.1f} after"
        + ("" if done.returncode == 0 else f"; **exited with {done.returncode}**"),
        "",
    ]
    table = first_table(out.read_text()) if out.exists() else None
    lines += [table, ""] if table else ["(no table written)", ""]
    lines.append(f"Full report: [{part.doc.name}]({part.doc.name})")
    print(f"== {part.name}: {seconds:.0f} s, exit {done.returncode}", flush=True)
    return done.returncode == 0, lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default=",".join(BY_NAME), help=f"of {', '.join(BY_NAME)}")
    parser.add_argument(
        "--quick", action="store_true", help="small sizes; reports go to a temp dir"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    unknown = [p for p in args.parts.split(",") if p not in BY_NAME]
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(BY_NAME)}")
    parts = [BY_NAME[p] for p in args.parts.split(",")]
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"elastrain-bench-{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    header = [
        f"Last run of `python bench/all.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"parts {', '.join(p.name for p in parts)})"
        + (" with --quick: small sizes, not figures" if args.quick else ""),
        "",
        f"- Machine: {machine()}",
        f"- Versions: {versions()}",
    ]
    target = scratch / args.out.name if args.quick else args.out
    text = args.out.read_text() if args.out.exists() else "# Benchmarks\n"
    text = replace_block(text, "run", "\n".join(header))
    failed: list[str] = []
    started = time.monotonic()
    for part in parts:
        out = scratch / part.doc.name if args.quick else part.doc
        ok, record = run_part(part, quick=args.quick, out=out)
        failed += [] if ok else [part.name]
        text = replace_block(text, part.name, "\n".join(record))
        target.write_text(text)  # after each part: a long run that stops keeps what it did
    print(f"wrote {target}; {time.monotonic() - started:.0f} s in all")
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (see the output above)")


if __name__ == "__main__":
    main()
