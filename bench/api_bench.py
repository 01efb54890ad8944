"""Benchmark the REST API: POST /v1/jobs throughput and p99, GET /v1/jobs/{id} p99.

Against a real server (`elastrain serve --no-scheduler`, one uvicorn process) with 10,000
jobs already stored, on SQLite and PostgreSQL; a few keep-alive connections in threads.
Reports medians of 3 runs, and the server's CPU time per request (from /proc), which says
what the server costs even when the machine is shared and wall-clock numbers are noisy.

    .venv/bin/python bench/api_bench.py                      # both databases
    .venv/bin/python bench/api_bench.py --backends sqlite --runs 1 --requests 500
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import insert  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

from bench.report_blocks import write_block  # noqa: E402
from elastrain.contracts.spec import JobSpec  # noqa: E402
from elastrain.service.db import make_engine, migrate  # noqa: E402
from elastrain.service.jobs import job_row_values  # noqa: E402
from elastrain.service.models import Event, Job, JobLabel  # noqa: E402

PG_ADMIN_URL = os.environ.get(
    "ELASTRAIN_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/test"
)

SPEC = {
    "name": "bench",
    "workload": {"name": "gpt", "params": {"n_layer": 4, "n_embd": 128, "n_head": 4}},
    "scaling": {"min_workers": 1, "max_workers": 2},
    "training": {"global_batch_size": 32, "micro_batch_size": 8, "max_steps": 200},
    "labels": {"team": "nlp", "bench": "yes"},
}


@dataclass
class Phase:
    throughput: float  # requests/s
    p50_ms: float
    p99_ms: float
    server_cpu_ms: float  # server CPU time per request


@contextmanager
def database(backend: str) -> Iterator[str]:
    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="elastrain-bench-") as tmp:
            yield f"sqlite:///{tmp}/bench.db"
        return
    import psycopg

    name = f"elastrain_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG_ADMIN_URL.rpartition('/')[0]}/{name}"
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def prefill(url: str, n: int) -> list[int]:
    """Store `n` jobs the way `create_job` would (job, labels, event), in bulk for speed."""
    engine = make_engine(url)
    migrate(engine)
    spec = JobSpec.model_validate(SPEC)
    row = job_row_values(spec, owner="default")
    ids: list[int] = []
    with Session(engine) as session:
        for start in range(0, n, 1000):
            batch = list(
                session.scalars(insert(Job).returning(Job.id), [row] * min(1000, n - start))
            )
            labels = [
                {"job_id": i, "key": k, "value": v} for i in batch for k, v in spec.labels.items()
            ]
            session.execute(insert(JobLabel), labels)
            events = [{"job_id": i, "to_state": "PENDING", "reason": "submitted"} for i in batch]
            session.execute(insert(Event), events)
            session.commit()
            ids += batch
    engine.dispose()
    return ids


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def server(url: str, storage: str) -> Iterator[tuple[str, int]]:
    port = _free_port()
    env = {**os.environ, "ELASTRAIN_DATABASE_URL": url, "ELASTRAIN_STORAGE_PATH": storage}
    cmd = [
        sys.executable,
        "-m",
        "elastrain.api.cli",
        "serve",
        "--no-scheduler",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"server exited: {proc.stderr.read().decode() if proc.stderr else ''}"
                )
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not come up in 60 s")
            time.sleep(0.2)
        yield base, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(
    base: str, pid: int, n: int, concurrency: int, request: Callable[[httpx.Client, int], int]
) -> Phase:
    """`n` requests over `concurrency` keep-alive connections; checks every status code."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def worker(indices: range) -> None:
        mine: list[float] = []
        with httpx.Client(base_url=base, timeout=30) as client:
            for i in indices:
                t0 = time.perf_counter()
                code = request(client, i)
                mine.append(time.perf_counter() - t0)
                if code >= 300:
                    errors.append(f"status {code}")
        with lock:
            latencies.extend(mine)

    shares = [range(k, n, concurrency) for k in range(concurrency)]
    threads = [threading.Thread(target=worker, args=(share,)) for share in shares]
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    if errors:
        raise RuntimeError(f"{len(errors)} failed requests, e.g. {errors[0]}")
    latencies.sort()
    return Phase(
        throughput=n / wall,
        p50_ms=1000 * latencies[len(latencies) // 2],
        p99_ms=1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        server_cpu_ms=1000 * cpu / n,
    )


def median_phase(phases: list[Phase]) -> Phase:
    return Phase(
        throughput=statistics.median(p.throughput for p in phases),
        p50_ms=statistics.median(p.p50_ms for p in phases),
        p99_ms=statistics.median(p.p99_ms for p in phases),
        server_cpu_ms=statistics.median(p.server_cpu_ms for p in phases),
    )


def bench_backend(backend: str, args: argparse.Namespace) -> tuple[Phase, Phase]:
    with database(backend) as url, tempfile.TemporaryDirectory() as storage:
        t0 = time.perf_counter()
        ids = prefill(url, args.jobs)
        print(f"[{backend}] {len(ids)} jobs stored in {time.perf_counter() - t0:.1f} s", flush=True)
        with server(url, storage) as (base, pid):

            def post(client: httpx.Client, _: int) -> int:
                return client.post("/v1/jobs", json=SPEC).status_code

            rng = random.Random(0)
            picks = [rng.choice(ids) for _ in range(max(args.requests, 200))]  # warm-up: 200

            def get(client: httpx.Client, i: int) -> int:
                return client.get(f"/v1/jobs/{picks[i]}").status_code

            load(base, pid, 200, args.concurrency, post)  # warm up: pools, caches, JIT-free paths
            load(base, pid, 200, args.concurrency, get)
            posts, gets = [], []
            for run in range(args.runs):
                posts.append(load(base, pid, args.requests, args.concurrency, post))
                gets.append(load(base, pid, args.requests, args.concurrency, get))
                print(f"[{backend}] run {run + 1}: POST {posts[-1]} / GET {gets[-1]}", flush=True)
    return median_phase(posts), median_phase(gets)


def render(results: dict[str, tuple[Phase, Phase]], args: argparse.Namespace, loadavg: str) -> str:
    lines = [
        "| database | POST /v1/jobs req/s | POST p50 ms | POST p99 ms | POST server CPU ms/req "
        "| GET /v1/jobs/{id} req/s | GET p50 ms | GET p99 ms | GET server CPU ms/req |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for backend, (post, get) in results.items():
        lines.append(
            f"| {backend} | {post.throughput:.0f} | {post.p50_ms:.1f} | {post.p99_ms:.1f} | "
            f"{post.server_cpu_ms:.2f} | {get.throughput:.0f} | {get.p50_ms:.1f} | "
            f"{get.p99_ms:.1f} | {get.server_cpu_ms:.2f} |"
        )
    setup = (
        f"{args.jobs} jobs stored before measuring; {args.requests} requests per phase over "
        f"{args.concurrency} keep-alive connections (httpx, threads, same machine); median of "
        f"{args.runs} runs. Server: `elastrain serve --no-scheduler`, one uvicorn process. "
        f"Machine: {os.cpu_count()} CPUs, Python {platform.python_version()}; load average "
        f"during the run: {loadavg}."
    )
    return "\n".join(lines) + "\n\n" + setup + "\n"


def write_report(path: Path, table: str) -> None:
    """Replace the figures in their block; keep the notes written around them."""
    new = "# API benchmark\n\nFigures from `bench/api_bench.py`.\n"
    write_block(path, "api-report", table, new_document=new)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs stored before measuring")
    parser.add_argument("--requests", type=int, default=2000, help="requests per phase and run")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench-api.md")
    args = parser.parse_args()

    before = os.getloadavg()
    results = {b: bench_backend(b, args) for b in args.backends.split(",")}
    after = os.getloadavg()
    table = render(results, args, f"{before[0]:.1f} at start, {after[0]:.1f} at end")
    print(table)
    if args.out and str(args.out) not in ("", "."):
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_report(args.out, table)


if __name__ == "__main__":
    main()
