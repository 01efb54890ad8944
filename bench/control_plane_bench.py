"""The control plane with a year of history: 10,000 jobs and 10,000,000 metric rows stored
in PostgreSQL, then submits at an offered 100/s and the dashboard's reads.

A real server (`elastrain serve --no-scheduler`, one uvicorn process), requests sent
open-loop at a fixed rate (each latency counted from when the request was due, so a slow
answer delays nothing and hides nothing), the server's CPU per request read from /proc.
Phases: POST /v1/jobs at `--rate`; GET /v1/jobs (the list's first page, as the dashboard
polls it); a job page's reads (GET the job, its metrics with max_points=2000, its events
and its checkpoints) of random stored jobs. `--runs` runs, medians reported with their
range.

    .venv/bin/python bench/control_plane_bench.py [--jobs 10000] [--metric-rows 10000000]
        [--rate 100] [--seconds 20] [--runs 3] [--out docs/bench-control-plane.md]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api_bench import SPEC, cpu_seconds, prefill, server
from scratch_db import scratch_database

from elastrain.service.db import make_engine


@dataclass(frozen=True)
class Result:
    name: str
    p50_ms: float
    p99_ms: float
    cpu_ms: float  # server CPU per request


def seed_metrics(url: str, job_ids: list[int], rows: int) -> float:
    """`rows` metric rows spread evenly over the jobs (as steps 1..n of each), generated in
    the server (one INSERT ... SELECT per chunk of jobs). Returns the seconds it took."""
    per_job = max(1, rows // len(job_ids))
    started = time.perf_counter()
    engine = make_engine(url)
    chunk = max(1, 500_000 // per_job)
    with engine.begin() as conn:
        for i in range(0, len(job_ids), chunk):
            ids = job_ids[i : i + chunk]
            conn.execute(
                sa.text(
                    "INSERT INTO metrics (job_id, step, attempt, at, values) "
                    "SELECT j, s, 1, now(), jsonb_build_object('loss', 3.0 / s, "
                    "'step_time_s', 0.1, 'samples_per_s', 320.0, 'lr', 0.001) "
                    "FROM unnest(CAST(:ids AS bigint[])) AS j, generate_series(1, :n) AS s"
                ),
                {"ids": ids, "n": per_job},
            )
            conn.execute(
                sa.text("UPDATE jobs SET step = :n WHERE id = ANY(CAST(:ids AS bigint[]))"),
                {"ids": ids, "n": per_job},
            )
        conn.execute(sa.text("ANALYZE"))
    engine.dispose()
    return time.perf_counter() - started


def open_loop(
    base: str, pid: int, name: str, rate: float, seconds: float, call: Callable[[httpx.Client], int]
) -> Result:
    """Send `call` every 1/rate s for `seconds` from a pool of keep-alive clients; each
    latency runs from the request's due time to its answer."""
    n = int(rate * seconds)
    latencies: list[float] = []
    errors: list[int] = []
    lock = threading.Lock()
    local = threading.local()
    # Made before the clock starts: an httpx client loads its certificate bundle when made,
    # and 16 of them made by the first requests' threads on a busy machine delayed those
    # requests by up to a second (the load generator's start-up, measured as the server's
    # p99).
    clients = [httpx.Client(base_url=base, timeout=30) for _ in range(16)]
    idle = list(clients)

    def take_client() -> None:
        local.client = idle.pop()

    def one(due: float) -> None:
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        code = call(local.client)
        took = time.perf_counter() - due
        with lock:
            latencies.append(took)
            if code >= 300:
                errors.append(code)

    cpu0 = cpu_seconds(pid)
    start = time.perf_counter() + 0.2
    with ThreadPoolExecutor(max_workers=len(clients), initializer=take_client) as pool:
        for k in range(n):
            due = start + k / rate
            # Hand work to the pool just before it is due (a queue of thousands of
            # sleeping tasks would need as many threads).
            lead = due - time.perf_counter() - 0.05
            if lead > 0:
                time.sleep(lead)
            pool.submit(one, due)
    cpu = cpu_seconds(pid) - cpu0
    for client in clients:
        client.close()
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} failed requests, e.g. status {errors[0]}")
    latencies.sort()
    return Result(
        name=name,
        p50_ms=1000 * latencies[len(latencies) // 2],
        p99_ms=1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        cpu_ms=1000 * cpu / n,
    )


def phases(
    base: str, pid: int, ids: list[int], rate: float, seconds: float, rng: random.Random
) -> list[Result]:
    def submit(client: httpx.Client) -> int:
        return client.post("/v1/jobs", json=SPEC).status_code

    def job_list(client: httpx.Client) -> int:
        return client.get("/v1/jobs", params={"limit": 50}).status_code

    def job_page(client: httpx.Client) -> int:
        job_id = rng.choice(ids)
        codes = [
            client.get(f"/v1/jobs/{job_id}").status_code,
            client.get(f"/v1/jobs/{job_id}/metrics", params={"max_points": 2000}).status_code,
            client.get(f"/v1/jobs/{job_id}/events").status_code,
            client.get(f"/v1/jobs/{job_id}/checkpoints").status_code,
        ]
        return max(codes)

    return [
        open_loop(base, pid, f"POST /v1/jobs at {rate:g}/s", rate, seconds, submit),
        open_loop(base, pid, "GET /v1/jobs (first page of 50) at 20/s", 20, seconds, job_list),
        open_loop(base, pid, "job page (4 GETs, metrics max_points=2000) at 10/s", 10, seconds,
                  job_page),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--metric-rows", type=int, default=10_000_000)
    parser.add_argument("--rate", type=float, default=100.0, help="submits offered per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase and run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--out", type=Path, default=Path("docs/bench-control-plane.md"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    runs: list[list[Result]] = []
    with (
        scratch_database(args.pg, "elastrain_cp_bench") as url,
        tempfile.TemporaryDirectory() as storage,
    ):
        t0 = time.perf_counter()
        ids = prefill(url, args.jobs)
        seeded_s = seed_metrics(url, ids, args.metric_rows)
        print(f"{len(ids)} jobs, {args.metric_rows:,} metric rows stored in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
        rng = random.Random(0)
        with server(url, storage) as (base, pid):
            phases(base, pid, ids, args.rate, 2, rng)  # warm up
            for run in range(args.runs):
                runs.append(phases(base, pid, ids, args.rate, args.seconds, rng))
                print(f"run {run + 1}: {runs[-1]}", flush=True)
    load_after = os.getloadavg()
    lines = [
        "# The control plane with a year of history",
        "",
        f"`python bench/control_plane_bench.py --jobs {args.jobs} --metric-rows "
        f"{args.metric_rows} --rate {args.rate:g} --seconds {args.seconds:g} --runs {args.runs}`"
        f": PostgreSQL holding {args.jobs:,} jobs and {args.metric_rows:,} metric rows "
        f"(seeded in {seeded_s:.0f} s); one `elastrain serve --no-scheduler` process; requests "
        "sent open-loop at a fixed rate from 16 client threads on the same 2 cores, latency from "
        f"when each was due; {args.seconds:g} s per phase, median of {args.runs} runs (range). "
        f"Load average {load_before[0]:.1f} before, {load_after[0]:.1f} after.",
        "",
        "| phase | p50 ms | p99 ms | server CPU ms per request (a job page: per page) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for i, first in enumerate(runs[0]):
        of = [r[i] for r in runs]

        def cell(values: list[float]) -> str:
            return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

        lines.append(
            f"| {first.name} | {cell([r.p50_ms for r in of])} | {cell([r.p99_ms for r in of])} "
            f"| {cell([r.cpu_ms for r in of])} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
