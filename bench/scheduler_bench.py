"""One scheduler pass with a crowded queue: 1,000 PENDING and 100 RUNNING jobs on
PostgreSQL (and SQLite), the fake launcher (no Ray), every running attempt reporting a
step each pass. What a pass costs the control plane, and what it would take to admit.

    .venv/bin/python bench/scheduler_bench.py [--pending 1000] [--running 100] [--passes 20]
        [--pg postgresql+psycopg://postgres@127.0.0.1:5432/postgres] [--out docs/bench-scheduler.md]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sqlalchemy as sa
from scratch_db import scratch_database

from elastrain.contracts.messages import DriverStatus
from elastrain.contracts.spec import JobSpec
from elastrain.service import jobs
from elastrain.service.db import make_engine, make_session_factory, migrate, session_scope
from elastrain.service.models import Job
from elastrain.service.scheduler import Scheduler
from elastrain.service.settings import Settings
from tests.fake_launcher import FakeLauncher

SPEC = {
    "name": "queued",
    "workload": {"name": "gpt"},
    "scaling": {"min_workers": 2, "max_workers": 2},
    "training": {"max_steps": 1_000_000},
}


def database_backends(engine: sa.Engine) -> list[int]:
    """The PostgreSQL server processes of the engine's pooled connections (none on SQLite:
    it runs in this process)."""
    if engine.dialect.name != "postgresql":
        return []
    with engine.connect() as conn:
        query = "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        return list(conn.scalars(sa.text(query)))


def backend_cpu_s(pids: list[int]) -> float:
    """CPU seconds the processes have used (the server runs on this machine)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def measure(
    name: str, url: str, pending: int, running: int, passes: int, tmp: Path
) -> dict[str, Any]:
    engine = make_engine(url)
    migrate(engine)
    sessions = make_session_factory(engine)
    # Exactly enough nodes for the running jobs: the queue stays queued (what a full
    # cluster looks like), and every pass still considers every pending job.
    launcher = FakeLauncher({f"n{i}": 2 for i in range(running)})
    settings = Settings(database_url=url, storage_path=tmp / name, restart_backoff_s=0)
    sched = Scheduler(session_factory=sessions, launcher=launcher, settings=settings)
    with session_scope(sessions) as s:
        for i in range(running):
            jobs.create_job(s, spec=JobSpec.model_validate({**SPEC, "name": f"run-{i}"}))
    sched.run_pass()  # admits them all
    step = 0

    def advance() -> None:
        nonlocal step
        step += 1
        for i, driver in enumerate(launcher.drivers.values()):
            driver.status = DriverStatus.RUNNING
            driver.metrics = [{"step": step, "loss": 2.0, "step_time_s": 0.1}]
            # Where its ranks run, as Ray reports it: job i fills node i.
            driver.placement = {0: f"n{i}", 1: f"n{i}"}

    advance()
    sched.run_pass()
    with session_scope(sessions) as s:
        for i in range(pending):
            jobs.create_job(s, spec=JobSpec.model_validate({**SPEC, "name": f"queued-{i}"}))
    times: list[float] = []
    cpu: list[float] = []
    db_cpu: list[float] = []
    profile = cProfile.Profile()
    for i in range(passes):
        advance()
        backends = database_backends(engine)
        db0, cpu0, t0 = backend_cpu_s(backends), time.process_time(), time.perf_counter()
        if i == passes - 1:
            profile.enable()
        sched.run_pass()
        profile.disable()
        times.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - cpu0) * 1000)
        db_cpu.append((backend_cpu_s(backends) - db0) * 1000)
    with session_scope(sessions) as s:
        counts = dict(s.execute(sa.select(Job.state, sa.func.count()).group_by(Job.state)).all())
    engine.dispose()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(18)
    times.sort()
    return {
        "db": name,
        "median_ms": statistics.median(times),
        "cpu_ms": statistics.median(cpu),
        # Counted in 10 ms ticks: the mean over the passes, not the median.
        "db_cpu_ms": statistics.mean(db_cpu) if backends else None,
        "p99_ms": times[-1],
        "states": {str(k.value if hasattr(k, "value") else k): v for k, v in counts.items()},
        "profile": out.getvalue(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pending", type=int, default=1000)
    parser.add_argument("--running", type=int, default=100)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--out", type=Path, default=Path("docs/bench-scheduler.md"))
    args = parser.parse_args()
    load = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(
            measure(
                "SQLite",
                f"sqlite:///{tmp}/s.db",
                args.pending,
                args.running,
                args.passes,
                Path(tmp),
            )
        )
        print(rows[-1]["db"], rows[-1]["median_ms"], flush=True)
        with scratch_database(args.pg, "elastrain_sched_bench") as url:
            rows.append(
                measure("PostgreSQL", url, args.pending, args.running, args.passes, Path(tmp))
            )
    lines = [
        "# A scheduler pass with a crowded queue",
        "",
        f"`python bench/scheduler_bench.py --pending {args.pending} --running {args.running} "
        f"--passes {args.passes}`: fake launcher (no Ray), {args.running} RUNNING jobs each reporting "
        f"a step per pass on a full cluster, {args.pending} PENDING jobs that cannot be admitted; "
        f"2-core machine, load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}. "
        "Medians of the passes; CPU: this process's (the scheduler, SQLite included), and "
        "PostgreSQL's server processes' for the engine's connections (the mean: /proc counts "
        "it in 10 ms ticks).",
        "",
        "| database | pass median ms | slowest pass ms | CPU ms per pass, scheduler | CPU ms per "
        "pass, database server | jobs by state after |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        db_cpu = "in process" if r["db_cpu_ms"] is None else f"{r['db_cpu_ms']:.0f}"
        lines.append(
            f"| {r['db']} | {r['median_ms']:.1f} | {r['p99_ms']:.1f} | {r['cpu_ms']:.1f} | "
            f"{db_cpu} | {r['states']} |"
        )
    lines += [
        "",
        "Where the last PostgreSQL pass spent its time (cProfile, cumulative):",
        "",
        "```",
    ]
    lines += rows[-1]["profile"].strip().splitlines()[:40]
    lines += ["```"]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
