"""Bring your own script: submit -> first reported step, command job vs built-in loop vs torchrun.

A local Ray with 2 CPUs and the service on top (its warm pool up before the first trial).
Three ways to start 2 ranks of DDP over gloo on a small MLP, each timed to its first
optimizer step, median of `--repeats`:

- command job: `workload.command: [python, byo_train.py]` with the script shipped as the
  job's package; the script imports torch, forms its group from torchrun's environment,
  takes a step and calls `report(1, loss=...)`: submit -> that point's wall time;
- built-in loop: the `synthetic` workload (same width) -> its first point's wall time;
- bare torchrun: `torchrun --standalone --nproc_per_node 2 byo_train.py` on this machine
  (no Ray, no service): launch -> the wall time the script prints at its first step.

    .venv/bin/python bench/command_bench.py [--repeats 5 | --quick] [--out docs/bench-command.md]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray

from bench.report_blocks import write_block
from elastrain.api.workdir import pack
from tests.integration.ray_service import ray_service, submit, wait_terminal

REPO = Path(__file__).resolve().parents[1]
WORKERS = 2

#: The user's script: torch.distributed from torchrun's environment, and `report`, which
#: does nothing outside elastrain (so the same file runs under bare torchrun).
SCRIPT = """
import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
try:
    from elastrain.workers.user_api import report
except ImportError:
    def report(step, loss=None, **metrics): pass

dist.init_process_group("gloo")
model = DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(1, 4):
    loss = model(torch.randn(16, 16)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    report(step, loss=loss.item())
    if step == 1 and dist.get_rank() == 0:
        print(f"first-step {time.time():.6f}", flush=True)
# No rank tears its group down while a peer may still be in its last collective: gloo then
# aborts at exit now and then ("terminate called without an active exception": seen in CI),
# under elastrain or torchrun alike (examples/torchrun/train.py ends the same way).
dist.barrier()
dist.destroy_process_group()
"""


def _first_wall_time(client: Any, job_id: int) -> float:
    points = client.get(f"/v1/jobs/{job_id}/metrics").json()
    assert points, f"job {job_id} reported nothing"
    return float(min(points, key=lambda p: p["step"])["wall_time"])


def wait_for_warm_pool(client: Any, minimum: int, timeout: float = 180) -> None:
    from elastrain.service.identity import runtime_control_token

    runtime = ray.get_actor("elastrain-runtime", namespace="elastrain-test")
    token = runtime_control_token(client.app.state.session_factory)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        idle = [w for w in ray.get(runtime.workers.remote(token)) if not w.busy]
        if len(idle) >= minimum:
            return
        time.sleep(0.5)
    raise TimeoutError("warm pool")


def upload(client: Any, folder: Path) -> str:
    packed = pack(folder)
    try:
        response = client.post("/v1/packages", content=packed.archive.read_bytes(),
                               headers={"Content-Type": "application/zip"})  # fmt: skip
        assert response.status_code in (200, 201), response.text
        return str(response.json()["digest"])
    finally:
        packed.archive.unlink(missing_ok=True)


SCALING = {"min_workers": WORKERS, "max_workers": WORKERS, "cpus_per_worker": 1}


def service_trial(client: Any, spec: dict[str, Any]) -> tuple[float, float]:
    """Submit -> the first step, and submit -> the group formed (a command job: rank 0's
    script started), from the attempt's timeline."""
    wait_for_warm_pool(client, WORKERS)
    t_submit = time.time()
    job_id = submit(client, spec)
    final = wait_terminal(client, job_id, timeout=300, poll_s=0.2)
    assert final["state"] == "SUCCEEDED", final
    events = client.get(f"/v1/jobs/{job_id}/events").json()
    timeline = next(e["details"] for e in events if e["kind"] == "timeline")
    formed = next(p["at"] for p in timeline["phases"] if p["phase"] == "group_formed")
    return _first_wall_time(client, job_id) - t_submit, formed - t_submit


def torchrun_trial(folder: Path) -> float:
    torchrun = Path(sys.executable).with_name("torchrun")
    t_launch = time.time()
    done = subprocess.run(
        [str(torchrun), "--standalone", f"--nproc_per_node={WORKERS}", "byo_train.py"],
        cwd=folder, check=True, capture_output=True, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    found = re.search(r"first-step (\d+\.\d+)", done.stdout)
    assert found is not None, done.stdout + done.stderr
    return float(found.group(1)) - t_launch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one trial each (CI)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-command.md")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    tmp = Path(tempfile.mkdtemp(prefix="command-bench-"))
    (tmp / "pkg").mkdir()
    (tmp / "pkg" / "byo_train.py").write_text(SCRIPT)
    times: dict[str, list[float]] = {"command": [], "builtin": [], "torchrun": []}
    formed: dict[str, list[float]] = {"command": [], "builtin": []}
    with ray_service(
        tmp, num_cpus=WORKERS, restart_backoff_s=0.2, allowed_hosts=["testserver"]
    ) as client:
        digest = upload(client, tmp / "pkg")
        command = {"name": "byo", "scaling": SCALING, "failure": {"max_restarts": 0},
                   "workload": {"command": ["python", "byo_train.py"], "package": digest}}  # fmt: skip
        builtin = {
            "name": "builtin", "scaling": SCALING, "failure": {"max_restarts": 0},
            "workload": {"name": "synthetic", "params": {"hidden": 64, "n_layer": 1}},
            "training": {"max_steps": 3, "global_batch_size": 32, "micro_batch_size": 16},
            "checkpoint": {"every_steps": 100, "async_save": False},
        }  # fmt: skip
        for _ in range(args.repeats):
            for name, spec in (("command", command), ("builtin", builtin)):
                first, started = service_trial(client, spec)
                times[name].append(first)
                formed[name].append(started)
    for _ in range(args.repeats):
        times["torchrun"].append(torchrun_trial(tmp / "pkg"))
    med = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: f"{min(v):.2f}-{max(v):.2f}" for k, v in times.items()}
    up = {k: statistics.median(v) for k, v in formed.items()}
    load = os.getloadavg()[0]
    lines = [
        f"`.venv/bin/python bench/command_bench.py --repeats {args.repeats}`: {WORKERS} ranks, "
        f"DDP over gloo, local Ray on this machine ({os.cpu_count()} cores, load average "
        f'{load:.1f} at the end), warm pool up. Seconds, median (min-max); "group formed" is '
        "the attempt's timeline mark (a command job: rank 0's script started).",
        "",
        "| start | submit/launch -> first step | submit -> group formed |",
        "| --- | --- | --- |",
        f"| command job (`workload.command`, script + `report`) | {med['command']:.2f} "
        f"({spread['command']}) | {up['command']:.2f} |",
        f"| built-in loop (`synthetic` workload) | {med['builtin']:.2f} ({spread['builtin']}) "
        f"| {up['builtin']:.2f} |",
        f"| bare torchrun (`--standalone`, no Ray) | {med['torchrun']:.2f} "
        f"({spread['torchrun']}) | - |",
    ]
    block = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_block(args.out, "command-report", block, new_document=TITLE)
    print(block)


TITLE = "# Bring your own script: time to the first step (`workload.command`)\n"


if __name__ == "__main__":
    main()
