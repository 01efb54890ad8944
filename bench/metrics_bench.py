"""What a long job's metrics cost to store and to read: a job of 1,000,000 steps on SQLite
and PostgreSQL, read downsampled (`max_points`, what the dashboard asks for), zoomed, and
as raw pages (what the dashboard read before), then thinned by retention.

    .venv/bin/python bench/metrics_bench.py [--steps 1000000] [--repeats 20]
        [--pg postgresql+psycopg://postgres@127.0.0.1:5432/postgres] [--out docs/bench-metrics.md]

Runs the API in-process (FastAPI's TestClient), so the figures are the server's time to
answer plus the in-process client, without a network.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("ELASTRAIN_ALLOWED_HOSTS", "testserver")

import sqlalchemy as sa
from fastapi.testclient import TestClient
from scratch_db import scratch_database

from elastrain.api.main import create_app
from elastrain.contracts.spec import JobSpec
from elastrain.service import metric_store
from elastrain.service.db import make_engine, make_session_factory, migrate, session_scope
from elastrain.service.jobs import create_job, get_job, set_job_state
from elastrain.service.models import Metric
from elastrain.service.settings import Settings
from elastrain.service.states import JobState

SPEC = {"name": "long", "workload": {"name": "gpt"}, "training": {"max_steps": 10_000_000}}


def values(step: int) -> dict[str, Any]:
    point: dict[str, Any] = {
        "loss": 4.0 * math.exp(-step / 200_000) + 0.05 * math.sin(step / 500),
        "lr": 3e-4, "step_time_s": 0.1 + 0.01 * math.sin(step / 77), "tokens_per_s": 20_000.0,
        "samples_per_s": 320.0, "world_size": 4, "dp": 4, "pp": 1, "tp": 1,
        "memory": {"param_bytes": 3_000_000, "grad_bytes": 3_000_000, "optim_bytes": 6_000_000},
        "batch_crc": 123456789, "wall_time": 1.8e9 + step,
    }  # fmt: skip
    if step % 10_000 == 0:
        point["eval_loss"] = point["loss"] + 0.2
    return point


def seed(url: str, steps: int) -> tuple[int, float]:
    engine = make_engine(url)
    migrate(engine)
    sessions = make_session_factory(engine)
    t0 = time.perf_counter()
    with session_scope(sessions) as s:
        job_id = create_job(s, spec=JobSpec.model_validate(SPEC)).id
    at = datetime.now(UTC)
    for start in range(1, steps + 1, 50_000):
        points = [(i, values(i)) for i in range(start, min(start + 50_000, steps + 1))]
        with session_scope(sessions) as s:
            metric_store.insert_bulk(s, job_id, points, attempt=1, at=at)
    with session_scope(sessions) as s:
        get_job(s, job_id).step = steps
    if engine.dialect.name == "postgresql":
        # What autovacuum does within a minute of a bulk load; without statistics the
        # planner scans the whole table.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("ANALYZE metrics"))
            conn.execute(sa.text("ANALYZE metric_buckets"))
    engine.dispose()
    return job_id, time.perf_counter() - t0


def timed(client: TestClient, path: str, params: dict[str, Any], repeats: int) -> dict[str, Any]:
    times, n = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        response = client.get(path, params=params)
        times.append((time.perf_counter() - t0) * 1000)
        assert response.status_code == 200, response.text
        n = len(response.json())
    times.sort()
    return {"points": n, "median_ms": statistics.median(times),
            "p99_ms": times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)]}  # fmt: skip


def measure(name: str, url: str, steps: int, repeats: int, storage: Path) -> list[dict[str, Any]]:
    job_id, seed_s = seed(url, steps)
    print(f"{name}: seeded {steps:,} steps in {seed_s:.0f} s", flush=True)
    rows: list[dict[str, Any]] = []
    settings = Settings(database_url=url, storage_path=storage)
    with TestClient(create_app(settings)) as client:
        path = f"/v1/jobs/{job_id}/metrics"
        cases = [
            ("whole run, max_points=2000 (the job page)", {"max_points": 2000}),
            ("a zoom: 10,000 steps, max_points=2000", {"since_step": steps // 2, "until_step": steps // 2 + 9_999, "max_points": 2000}),
            ("new steps only (the page's poll)", {"since_step": steps + 1, "max_points": 2000}),
            ("one raw page of 10,000 rows (before: the page read 20 of these)", {"since_step": 1}),
        ]  # fmt: skip
        for label, params in cases:
            rows.append({"db": name, "case": label, **timed(client, path, params, repeats)})
            print(rows[-1], flush=True)
        before = client.get(path, params={"max_points": 2000}).json()
        engine = make_engine(url)
        sessions = make_session_factory(engine)
        with session_scope(sessions) as s:
            set_job_state(s, get_job(s, job_id), JobState.CANCELLED, reason="done")
        t0 = time.perf_counter()
        with session_scope(sessions) as s:
            deleted = metric_store.thin(s, get_job(s, job_id), now=datetime.now(UTC))
        thin_s = time.perf_counter() - t0
        with session_scope(sessions) as s:
            left = s.scalar(
                sa.select(sa.func.count()).select_from(Metric).where(Metric.job_id == job_id)
            )
        engine.dispose()
        after = client.get(path, params={"max_points": 2000}).json()
        rows.append(
            {
                "db": name,
                "case": "whole run after thinning",
                **timed(client, path, {"max_points": 2000}, repeats),
            }
        )
        rows[-1]["thin"] = {
            "seconds": thin_s,
            "deleted": deleted,
            "left": left,
            "same_curve": after == before,
        }
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--out", type=Path, default=Path("docs/bench-metrics.md"))
    args = parser.parse_args()
    started = time.time()
    load = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        rows += measure(
            "SQLite", f"sqlite:///{tmp}/bench.db", args.steps, args.repeats, Path(tmp) / "st"
        )
        with scratch_database(args.pg, "elastrain_metrics_bench") as url:
            rows += measure("PostgreSQL", url, args.steps, args.repeats, Path(tmp) / "st2")
    lines = [
        "# Metrics of a long job: downsampled reads and retention",
        "",
        f"`python bench/metrics_bench.py --steps {args.steps} --repeats {args.repeats}`: one job with "
        f"{args.steps:,} metric rows (the values a gpt step reports), API in-process (TestClient), "
        f"{args.repeats} requests per case; 2-core machine, load average at start "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}.",
        "",
        "| database | request | points | median ms | p99 ms |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['db']} | {r['case']} | {r['points']} | {r['median_ms']:.1f} | {r['p99_ms']:.1f} |"
        )
    lines += ["", "Retention (`ELASTRAIN_METRICS_THIN_AFTER_DAYS`), run on the finished job:", ""]
    for r in rows:
        if "thin" in r:
            t = r["thin"]
            lines.append(
                f"- {r['db']}: {t['deleted']:,} rows deleted, {t['left']:,} kept, in {t['seconds']:.1f} s; "
                f"the 2,000-point curve after it is {'identical' if t['same_curve'] else 'DIFFERENT'}."
            )
    lines += ["", f"Total bench time {time.time() - started:.0f} s."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
