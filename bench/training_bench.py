"""Steps/s of each strategy on CPU with 1, 2 and 4 workers (tensor parallel included),
parameter bytes per rank, and submit -> first step time.

Runs the real service on a local Ray (4 logical CPUs on this 2-core machine), submits the
`gpt` workload over REST once per (strategy, world size), one job at a time, and reads
the job's own metrics: median step time over the steady-state steps, tokens/s, and the
time from submit (the job's created_at) to the end of its first step.

    .venv/bin/python bench/training_bench.py [--steps 40] [--quick] [--out docs/bench-training.md]
    .venv/bin/python bench/training_bench.py --compile [--steps 60]   # eager vs training.compile

The report goes between its markers in `--out`; notes written around them stay.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report_blocks import write_block
from tests.integration.ray_service import ray_service, submit, tiny_gpt_spec, wait_terminal

#: The API answers only the Host names it is configured for (ELASTRAIN_ALLOWED_HOSTS), as a
#: user's server is told its own; Starlette's TestClient sends `Host: testserver`.
SERVICE = {"allowed_hosts": ["testserver"]}
#: Steps up to this one (process group warm-up, first allocations) are left out of the rates.
STEADY_AFTER = 5
GPT = {"n_layer": 2, "n_embd": 64, "n_head": 4, "seq_len": 64}
CASES = [
    ("ddp", {"kind": "ddp"}, 1),
    ("ddp", {"kind": "ddp"}, 2),
    ("fsdp", {"kind": "fsdp"}, 1),
    ("fsdp", {"kind": "fsdp"}, 2),
    (
        "pipeline gpipe",
        {"kind": "pipeline", "pipeline_stages": 2, "microbatches": 4, "schedule": "gpipe"},
        2,
    ),
    (
        "pipeline 1f1b",
        {"kind": "pipeline", "pipeline_stages": 2, "microbatches": 4, "schedule": "1f1b"},
        2,
    ),
    ("tp2", {"kind": "tp", "tensor_parallel": 2}, 2),
    ("tp2", {"kind": "tp", "tensor_parallel": 2}, 4),
    ("fsdp+tp2", {"kind": "fsdp", "tensor_parallel": 2}, 4),
    (
        "pipeline+tp2 1f1b",
        {"kind": "pipeline", "pipeline_stages": 2, "microbatches": 4, "tensor_parallel": 2},
        4,
    ),
]


#: `--quick` (what CI runs): the simplest case and the one with the most parts (3-D), enough
#: to show the script still runs; tests/integration/test_training_ray.py trains every strategy
#: through the service.
QUICK_CASES = [CASES[1], CASES[-1]]
#: `--compile`: each strategy that compiles, eager then `training.compile`, side by side.
COMPILE_CASES = [
    (f"{name} {mode}", strategy, 2, {"compile": mode == "compiled"})
    for name, strategy in (
        ("ddp", {"kind": "ddp"}),
        ("fsdp", {"kind": "fsdp"}),
        ("tp2", {"kind": "tp", "tensor_parallel": 2}),
    )
    for mode in ("eager", "compiled")
]
Case = tuple[str, dict[str, object], int] | tuple[str, dict[str, object], int, dict[str, object]]


def run(steps: int, cases: list[Case]) -> list[dict[str, object]]:
    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        ray_service(Path(tmp), num_cpus=4, **SERVICE) as client,
    ):
        for name, strategy, workers, *more in cases:
            training = more[0] if more else {}
            spec = tiny_gpt_spec(
                f"bench-{name}-{workers}",
                workload={"name": "gpt", "params": GPT},
                strategy=strategy,
                scaling={"min_workers": workers, "max_workers": workers, "cpus_per_worker": 1},
                training={
                    "global_batch_size": 32,
                    "micro_batch_size": 16,
                    "max_steps": steps,
                    **training,
                },
                checkpoint={"every_steps": steps, "keep_last": 2},
            )
            job_id = submit(client, spec)
            job = wait_terminal(client, job_id, timeout=900)
            assert job["state"] == "SUCCEEDED", job
            points = client.get(f"/v1/jobs/{job_id}/metrics").json()
            steady = [p for p in points if p["step"] > STEADY_AFTER]
            step_time = statistics.median(p["step_time_s"] for p in steady)
            created = datetime.fromisoformat(job["created_at"]).timestamp()
            first = min(points, key=lambda p: p["step"])
            rows.append(
                {
                    "strategy": name,
                    "workers": workers,
                    "steps_per_s": 1.0 / step_time,
                    "tokens_per_s": statistics.median(p["tokens_per_s"] for p in steady),
                    "submit_to_first_step_s": first["wall_time"] - created,
                    "param_bytes": points[-1]["memory"]["param_bytes"],
                    "final_loss": points[-1]["loss"],
                }
            )
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--steps", type=int, default=40, help=f"per job; above {STEADY_AFTER} (the steady steps)"
    )
    parser.add_argument("--out", type=Path, default=Path("docs/bench-training.md"))
    parser.add_argument(
        "--quick", action="store_true", help=f"{len(QUICK_CASES)} of the {len(CASES)} cases"
    )
    parser.add_argument(
        "--compile", action="store_true", help="eager vs training.compile, per strategy"
    )
    args = parser.parse_args()
    if args.steps <= STEADY_AFTER:
        parser.error(f"--steps must be above {STEADY_AFTER}: the figures are of later steps")
    started = time.time()
    if args.compile:
        compile_report(args.steps, args.out, started)
        return
    rows = run(args.steps, QUICK_CASES if args.quick else CASES)
    lines = [
        f"`python bench/training_bench.py --steps {args.steps}{' --quick' if args.quick else ''}`: "
        f"gpt workload {GPT}, global batch 32,",
        "micro-batch 16, 1 CPU per worker, local Ray with 4 logical CPUs on a 2-core machine, one job",
        "at a time (4 workers share 2 cores: those rows measure that it works and what a rank holds,",
        "not speed; tensor parallelism's per-block all-reduces over gloo on CPU are pure cost here).",
        f"Steps/s and tokens/s are medians over steps {STEADY_AFTER + 1}..{args.steps}; submit -> first step is from",
        "the job's creation to the end of its first optimizer step (Ray worker start, process",
        "group, model build, first step).",
        "",
        "| strategy | workers | steps/s | tokens/s | parameter KiB per rank | submit -> first step (s) | final loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['workers']} | {r['steps_per_s']:.2f} | {r['tokens_per_s']:.0f} "
            f"| {int(r['param_bytes']) / 1024:.0f} | {r['submit_to_first_step_s']:.1f} "
            f"| {r['final_loss']:.3f} |"
        )
    lines += ["", f"Total bench time {time.time() - started:.0f} s."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    block = "\n".join(lines)
    write_block(args.out, "training-report", block, new_document=TITLE)
    print(block)


def compile_report(steps: int, out: Path, started: float) -> None:
    rows = run(steps, COMPILE_CASES)  # type: ignore[arg-type]
    lines = [
        f"`python bench/training_bench.py --compile --steps {steps}`: the same gpt {GPT} and",
        "batches as above, 2 workers, each strategy eager then with `training.compile: true`",
        "(torch.compile per block, inductor on CPU), one job after the other in one service.",
        "Submit -> first step includes the compile (inductor's on-disk cache is warm after the",
        "first job of a machine).",
        "",
        "| strategy | steps/s | compiled / eager | submit -> first step (s) | final loss |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for eager, compiled in zip(rows[::2], rows[1::2], strict=True):
        for r in (eager, compiled):
            ratio = float(r["steps_per_s"]) / float(eager["steps_per_s"])  # type: ignore[arg-type]
            lines.append(
                f"| {r['strategy']} | {r['steps_per_s']:.2f} | {ratio:.2f}x "
                f"| {r['submit_to_first_step_s']:.1f} | {r['final_loss']:.4f} |"
            )
    lines += ["", f"Total bench time {time.time() - started:.0f} s."]
    block = "\n".join(lines)
    write_block(out, "compile-report", block, new_document=TITLE)
    print(block)


TITLE = "# Training throughput on CPU (gloo)\n"


if __name__ == "__main__":
    main()
