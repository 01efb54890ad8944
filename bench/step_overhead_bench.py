"""Steady-state step time: an elastrain job vs the same training as a plain torchrun script.

For each strategy (ddp, fsdp, pipeline) on 2 workers: the gpt workload, same data, global
batch, micro-batch and optimizer, run alternately (elastrain, torchrun, elastrain, ...)
`--repeats` times each. elastrain runs through the service on a local Ray, metrics flowing
to the database every step; the baseline is `bench/plain_torchrun.py` under
`torchrun --standalone` (no Ray, no service). Per run, the median interval between the
ends of consecutive optimizer steps after `--warmup` steps; reported: the median of those
medians for each side, their spread, and the ratio (elastrain / torchrun).

    .venv/bin/python bench/step_overhead_bench.py [--repeats 5] [--steps 300] [--out docs/bench-step-overhead.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("ELASTRAIN_ALLOWED_HOSTS", "testserver")

from elastrain.service.settings import Settings
from tests.integration.ray_service import ray_service, submit, tiny_gpt_spec, wait_terminal

#: The service as a user runs it: the default scheduler interval (tests use a shorter one).
SERVICE = {"scheduler_interval_s": Settings.model_fields["scheduler_interval_s"].default}

PARAMS = {"n_layer": 2, "n_embd": 64, "n_head": 4, "seq_len": 64}
GLOBAL_BATCH, MICRO_BATCH, WORKERS = 32, 16, 2
STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"kind": "ddp"},
    "fsdp": {"kind": "fsdp"},
    "pipeline": {"kind": "pipeline", "pipeline_stages": 2, "microbatches": 2, "schedule": "1f1b"},
}


def intervals(ends: list[float], warmup: int) -> float:
    """Median seconds between consecutive step ends, after `warmup` steps."""
    steady = ends[warmup:]
    return statistics.median(b - a for a, b in pairwise(steady))


def cpu_seconds() -> dict[int, float]:
    """Every process's CPU seconds so far (user + system, from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


OTHER_CPU_MS: dict[str, list[float]] = {}


def run_elastrain(client: Any, strategy: str, steps: int, warmup: int) -> float:
    spec = tiny_gpt_spec(
        f"overhead-{strategy}",
        workload={"name": "gpt", "params": PARAMS},
        strategy=STRATEGIES[strategy],
        scaling={"min_workers": WORKERS, "max_workers": WORKERS, "cpus_per_worker": 1},
        training={"global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO_BATCH,
                  "max_steps": steps, "learning_rate": 3e-4},
        # No checkpoint inside the measured steps (the checkpoint bench measures those).
        checkpoint={"every_steps": steps, "keep_last": 2},
    )  # fmt: skip
    before = cpu_seconds()
    job_id = submit(client, spec)
    # Nobody watches a torchrun script: the bench looks at the job only every 2 s.
    job = wait_terminal(client, job_id, timeout=900, poll_s=2.0)
    after = cpu_seconds()
    assert job["state"] == "SUCCEEDED", job
    points = client.get(f"/v1/jobs/{job_id}/metrics").json()
    events = client.get(f"/v1/jobs/{job_id}/events").json()
    ranks = {
        int(p) for e in events if e["kind"] == "placement" for p in e["details"]["pids"].values()
    }
    # What every process but the training ranks (the service, the runtime actor, Ray's
    # daemons, idle pooled processes) used on the same cores, per step.
    other = sum(after[p] - before.get(p, 0.0) for p in after if p not in ranks)
    OTHER_CPU_MS.setdefault(strategy, []).append(other / steps * 1000)
    return intervals([p["wall_time"] for p in sorted(points, key=lambda p: p["step"])], warmup)


def run_torchrun(strategy: str, steps: int, warmup: int, folder: Path) -> float:
    out = folder / f"{strategy}-{time.time_ns()}.json"
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORKERS}",
         str(Path(__file__).with_name("plain_torchrun.py")), "--strategy", strategy,
         "--steps", str(steps), "--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(MICRO_BATCH),
         "--params", json.dumps(PARAMS), "--out", str(out)],
        check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    return intervals(json.loads(out.read_text()), warmup)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--strategies", default="ddp,fsdp,pipeline")
    parser.add_argument("--out", type=Path, default=Path("docs/bench-step-overhead.md"))
    parser.add_argument(
        "--scheduler-interval",
        type=float,
        default=SERVICE["scheduler_interval_s"],
        help="seconds between the service's scheduler passes (default: the service's own)",
    )
    args = parser.parse_args()
    service = {**SERVICE, "scheduler_interval_s": args.scheduler_interval}
    started, load = time.time(), os.getloadavg()
    results: dict[str, dict[str, list[float]]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        ray_service(Path(tmp), num_cpus=4, **service) as client,
    ):
        for strategy in args.strategies.split(","):
            runs: dict[str, list[float]] = {"elastrain": [], "torchrun": []}
            for i in range(args.repeats):
                runs["elastrain"].append(run_elastrain(client, strategy, args.steps, args.warmup))
                runs["torchrun"].append(run_torchrun(strategy, args.steps, args.warmup, Path(tmp)))
                print(
                    strategy, i, {k: f"{v[-1] * 1000:.1f} ms" for k, v in runs.items()}, flush=True
                )
            results[strategy] = runs
    lines = [
        "# Steady-state step time: elastrain vs plain torchrun",
        "",
        f"`python bench/step_overhead_bench.py --repeats {args.repeats} --steps {args.steps}"
        f"{'' if service == SERVICE else f' --scheduler-interval {args.scheduler_interval:g}'}`: gpt "
        f"{PARAMS}, global batch {GLOBAL_BATCH}, micro-batch {MICRO_BATCH} (pipeline: 2 stages, "
        f"1F1B over the 2 micro-batches), {WORKERS} workers, gloo on CPU; runs alternate elastrain "
        f"/ torchrun. Per run: the median interval between step ends after step {args.warmup}; "
        "each elastrain run over the torchrun run after it is one pair's ratio. "
        f"2-core machine, load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}.",
        "",
        "| strategy | elastrain ms/step (median, range) | torchrun ms/step (median, range) | ratio "
        "| pairs' ratios (min-max) | CPU ms per step of every other process during the elastrain run |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for strategy, runs in results.items():
        e, t = runs["elastrain"], runs["torchrun"]
        # The spread of the pairs says how far apart two runs minutes apart can be here.
        pairs = [a / b for a, b in zip(e, t, strict=True)]
        lines.append(
            f"| {strategy} | {statistics.median(e) * 1000:.1f} ({min(e) * 1000:.1f}-{max(e) * 1000:.1f}) "
            f"| {statistics.median(t) * 1000:.1f} ({min(t) * 1000:.1f}-{max(t) * 1000:.1f}) "
            f"| {statistics.median(e) / statistics.median(t):.3f} "
            f"| {min(pairs):.3f}-{max(pairs):.3f} "
            f"| {statistics.median(OTHER_CPU_MS[strategy]):.1f} |"
        )
    lines += ["", f"Total bench time {time.time() - started:.0f} s."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
