"""Every part of issue 14's steady-state benchmarks, alone or all together, in one command.

Each part is its own script (it writes its full report to `docs/bench-<part>.md`); this
runs the chosen parts one after another, records the machine, the versions, the load
average before and after each part, its command and its wall time, and writes that run
record and each part's headline table into `docs/benchmarks.md`, each between its own
markers (a part run alone replaces its block only; the status and the analysis written
around the blocks stay).

    .venv/bin/python bench/all.py                        # every part (about 40 minutes)
    .venv/bin/python bench/all.py --parts scheduler,metrics
    .venv/bin/python bench/all.py --quick                # small sizes: checks the scripts run
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
         ("--repeats", "5", "--steps", "300"), ("--repeats", "1", "--steps", "20", "--warmup", "5")),
    Part("checkpoint", "2. Checkpoint stall and throughput", "checkpoint_bench.py",
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
)  # fmt: skip
BY_NAME = {p.name: p for p in PARTS}


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


def run_part(part: Part, *, quick: bool, out: Path) -> list[str]:
    """Run one part's script; its record (command, load, time, outcome, headline table)."""
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
    return lines


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
    for part in parts:
        out = scratch / part.doc.name if args.quick else part.doc
        text = replace_block(text, part.name, "\n".join(run_part(part, quick=args.quick, out=out)))
        target.write_text(text)  # after each part: a long run that stops keeps what it did
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
