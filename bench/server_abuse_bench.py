"""Other clients' latency while one client abuses the HTTP server (issue 26, item 6).

    .venv/bin/python bench/server_abuse_bench.py [--runs 3] [--seconds 8] [--out docs/bench-abuse.md]

The API (SQLite, 200 jobs stored) runs in its own process, as `elastrain serve` runs it:
with the guarded protocol (`api/http_guard.py`, default limits), and, side by side in the
same run, with plain uvicorn httptools (what `serve` ran before). For each server and each
abuse, a measuring client (one keep-alive connection, about 25 requests/s alternating
`GET /healthz` and `GET /v1/jobs`) records every latency while an abuser process:

- `none`: nothing (the baseline);
- `64MB-header`: sends requests whose one header is 64 MB, as fast as it can, over and over;
- `1000-half-open`: holds 1,000 connections that sent half a request line and then nothing,
  opening new ones as the server closes them.

Reported: p50 and p99 per endpoint, the median of `--runs` runs, and how many of the
abuser's connections the server held open at the end. Target: p99 under 100 ms with abuse.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import multiprocessing.synchronize
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
ABUSES = ("none", "64MB-header", "1000-half-open")

SERVER = """
import sys, uvicorn
from elastrain.api.main import create_app
from elastrain.api.cli.server import guarded_http
from elastrain.service.settings import Settings
settings = Settings()
options = guarded_http(settings) if sys.argv[1] == "guarded" else {"http": "httptools"}
uvicorn.run(create_app(settings), host="127.0.0.1", port=int(sys.argv[2]),
            log_level="critical", **options)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(kind: str, folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "ELASTRAIN_DATABASE_URL": f"sqlite:///{folder / 'db.sqlite'}",
        "ELASTRAIN_STORAGE_PATH": str(folder / "storage"),
    }
    proc = subprocess.Popen([sys.executable, "-c", SERVER, kind, str(port)], env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the {kind} server did not start")


def seed(url: str, jobs: int) -> None:
    spec = {"name": "bench", "workload": {"name": "synthetic"}, "training": {"max_steps": 10}}
    with httpx.Client(base_url=url, timeout=10) as client:
        for _ in range(jobs):
            client.post("/v1/jobs", json=spec).raise_for_status()


# --- abusers (each in its own process: another client, not this one's event loop) --------


def big_headers(port: int, header_mb: int, stop: multiprocessing.synchronize.Event) -> None:
    chunk = b"a" * 2**20
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
                for _ in range(header_mb):
                    if stop.is_set():
                        return
                    sock.sendall(chunk)
                sock.sendall(b"\r\n\r\n")
                sock.recv(4096)
        except OSError:
            time.sleep(0.01)  # refused or reset: at once again


def half_open(port: int, count: int, stop: multiprocessing.synchronize.Event) -> None:
    async def hold_one() -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /v1/jo")  # half a request line, then nothing
                await writer.drain()
                await reader.read()  # until the server closes it
                writer.close()
            except OSError:
                await asyncio.sleep(0.05)

    async def main() -> None:
        tasks = [asyncio.create_task(hold_one()) for _ in range(count)]
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for task in tasks:
            task.cancel()

    asyncio.run(main())


def start_abuse(
    abuse: str, port: int, *, header_mb: int, half_open_count: int
) -> tuple[multiprocessing.Process | None, multiprocessing.synchronize.Event]:
    stop = multiprocessing.Event()
    if abuse == "none":
        return None, stop
    target, args = (
        (big_headers, (port, header_mb, stop))
        if abuse == "64MB-header"
        else (half_open, (port, half_open_count, stop))
    )
    proc = multiprocessing.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc, stop


# --- the measuring client --------------------------------------------------------------


def measure(url: str, seconds: float, rate: float) -> dict[str, list[float]]:
    """Latencies (ms) per endpoint; a request that fails counts as its time to fail."""
    out: dict[str, list[float]] = {"/healthz": [], "/v1/jobs": []}
    failures = 0
    with httpx.Client(base_url=url, timeout=10) as client:
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            path = "/healthz" if i % 2 == 0 else "/v1/jobs"
            t0 = time.perf_counter()
            try:
                ok = client.get(path).status_code == 200
            except httpx.TransportError:
                ok = False
            out[path].append((time.perf_counter() - t0) * 1000)
            failures += not ok
            i += 1
            time.sleep(max(0.0, 1 / rate - (time.perf_counter() - t0)))
    out["failures"] = [float(failures)]
    return out


def open_connections(pid: int) -> int:
    """TCP sockets the server process holds (its listening one excluded)."""
    fds = Path(f"/proc/{pid}/fd")
    count = 0
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd).startswith("socket:")
    return max(count - 1, 0)


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run(kind: str, abuse: str, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        server, url = start_server(kind, Path(tmp))
        try:
            seed(url, args.jobs)
            port = int(url.rsplit(":", 1)[1])
            abuser, stop = start_abuse(
                abuse, port, header_mb=args.header_mb, half_open_count=args.half_open
            )
            time.sleep(args.warmup)  # the abuse in full swing
            lat = measure(url, args.seconds, args.rate)
            held = open_connections(server.pid)
            stop.set()
            if abuser is not None:
                abuser.join(5)
                if abuser.is_alive():
                    abuser.kill()
        finally:
            server.terminate()
            server.wait(10)
    return {
        "healthz_p50": p(lat["/healthz"], 0.5),
        "healthz_p99": p(lat["/healthz"], 0.99),
        "jobs_p50": p(lat["/v1/jobs"], 0.5),
        "jobs_p99": p(lat["/v1/jobs"], 0.99),
        "failures": lat["failures"][0],
        "requests": float(len(lat["/healthz"]) + len(lat["/v1/jobs"])),
        "held": float(held),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rate", type=float, default=25.0, help="requests/s of the measurer")
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--header-mb", type=int, default=64)
    parser.add_argument("--half-open", type=int, default=1000)
    parser.add_argument("--servers", default="guarded,plain")
    parser.add_argument("--abuses", default=",".join(ABUSES))
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench-abuse.md")
    args = parser.parse_args()
    rows = []
    load_before = os.getloadavg()[0]
    for abuse in args.abuses.split(","):
        for kind in args.servers.split(","):
            runs = [run(kind, abuse, args) for _ in range(args.runs)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            worst = max(r["jobs_p99"] for r in runs), max(r["healthz_p99"] for r in runs)
            print(f"{abuse:16s} {kind:8s} {med}", flush=True)
            rows.append((abuse, kind, med, worst))
    lines = [
        "# Other clients' latency while one client abuses the server",
        "",
        "| abuse | server | /healthz p50 / p99 | GET /v1/jobs p50 / p99 | failed requests | abuser's connections open at the end |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for abuse, kind, m, _ in rows:
        lines.append(
            f"| {abuse} | {kind} | {m['healthz_p50']:.1f} / {m['healthz_p99']:.1f} ms | "
            f"{m['jobs_p50']:.1f} / {m['jobs_p99']:.1f} ms | {m['failures']:.0f} of "
            f"{m['requests']:.0f} | {m['held']:.0f} |"
        )
    lines += [
        "",
        f"Medians of {args.runs} run(s) of {args.seconds:g} s each (worst run's p99 below); "
        f"the measuring client sends {args.rate:g} requests/s on one keep-alive connection; "
        f"{args.jobs} jobs stored (SQLite); abuse: a {args.header_mb} MB header sent over and "
        f"over, or {args.half_open} half-open connections. `guarded`: `elastrain serve`'s "
        "protocol (api/http_guard.py, default limits: 64 KiB of headers, 10 s to send them, "
        "2,048 connections, 5 s keep-alive); `plain`: uvicorn's httptools protocol as before. "
        f"Load average {load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after; "
        f"{os.cpu_count()} CPUs shared by the server, the abuser and the measurer.",
        "",
        "Worst run's p99 (GET /v1/jobs, /healthz): "
        + "; ".join(f"{a} {k}: {w[0]:.0f}, {w[1]:.0f} ms" for a, k, _, w in rows),
        "",
        "Command: `python bench/server_abuse_bench.py "
        + " ".join(sys.argv[1:]).replace(str(args.out), "").replace("--out", "").strip()
        + "`",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
