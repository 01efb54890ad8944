"""A one-command GPU check (`make gpu-check`): bf16 DDP and FSDP2 through the service on
warm GPU processes, against the same model as a plain torchrun script, on this machine's
NVIDIA GPUs. Writes docs/bench-gpu.md (between its markers; the notes around stay).

    python bench/gpu_check.py [--quick] [--out docs/bench-gpu.md] [--time-limit 480]

Steps, each printed as it starts and ends, each bounded by what is left of `--time-limit`;
a step that fails is recorded and the report is written all the same:

1. environment: torch and CUDA, the GPUs, the service's packages (missing ones are
   installed into .gpu-site/ from wheels under $GPU_WHEELS or .whl/, split wheels
   `NAME.whl.partNN` joined first, else from the package index when one is reachable);
2. plain torchrun, bf16 DDP and FSDP2 (bench/plain_torchrun.py --device cuda), one rank
   per GPU: tokens/s and MFU from the mean step time over the measured steps;
3. the service in this process (the integration tests' harness: a local Ray, the API in
   a TestClient, the scheduler thread, SQLite): its pool starts one process per GPU; a
   DDP job runs in them (its start timeline), a forced recovery that keeps the processes
   (the attempt released under the job: the state from their memory), a recovery from a
   killed process (the state from a peer, else the checkpoint), async checkpoints every
   `--checkpoint-every` steps, then the same job with synchronous saves for the reference;
4. the same for FSDP2 (no process killed);
5. the report: tokens/s and MFU side by side (target: service / plain >= 0.98), the
   Timeline of every start and recovery, the checkpoint stall and whole cost against a
   synchronous save (target <= 5 %).

One GPU: a job runs at world size 1 (two ranks of one NCCL group cannot share a GPU), so
a killed process has no surviving peer: that recovery restores from the checkpoint, and
no resize is possible. With several GPUs the jobs run one rank per GPU and the killed
rank's peers hand the state on.

Without CUDA (every CI machine) it prints "no GPU: skipped, nothing measured", writes
that to `--out` in quick mode (a temp file under bench/all.py) and leaves the real
document alone otherwise; it exits 0: this is a bench that cannot run here, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastrain.workers.devices import TEST_GPU_ON_CPU, gpu_on_cpu  # noqa: E402 (no torch import)

SITE = ROOT / ".gpu-site"
PROFILES = ROOT / ".gpu-site" / "profiles.txt"
#: module -> the distribution that provides it (what the service imports beyond torch).
SERVICE_MODULES = {
    "ray": "ray",
    "fastapi": "fastapi",
    "sqlalchemy": "sqlalchemy",
    "alembic": "alembic",
    "pydantic": "pydantic",
    "pydantic_settings": "pydantic-settings",
    "httpx": "httpx",
    "yaml": "pyyaml",
    "prometheus_client": "prometheus-client",
    "pathspec": "pathspec",
    "typer": "typer",
    "numpy": "numpy",
}
#: Shapes: (model params, global batch, micro batch, steps measured, checkpoint every).
FULL = ({"n_layer": 12, "n_embd": 768, "n_head": 12, "seq_len": 512}, 64, 16, 60, 20)
QUICK = ({"n_layer": 2, "n_embd": 128, "n_head": 4, "seq_len": 128}, 16, 8, 20, 8)
WARMUP_STEPS = 5
MARK = "gpu-check-report"


def say(text: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {text}", flush=True)


@dataclass
class Report:
    quick: bool
    started: float = field(default_factory=time.time)
    environment: list[str] = field(default_factory=list)
    throughput: list[tuple[str, str, float | None, float | None]] = field(default_factory=list)
    """(strategy, who: plain | service, tokens/s, MFU)."""
    timelines: list[tuple[str, str, dict[str, float], str]] = field(default_factory=list)
    """(job, cause, phase -> seconds since detected, restore source)."""
    checkpoints: list[tuple[str, str, float]] = field(default_factory=list)
    """(strategy, what, seconds)."""
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    """(what, held, detail)."""
    failures: list[str] = field(default_factory=list)

    def check(self, what: str, held: bool, detail: str = "") -> None:
        self.checks.append((what, held, detail))
        say(f"{'ok' if held else 'NOT MET'}: {what} {detail}")


class Deadline:
    """What is left of `--time-limit`; a step past it fails with TimeoutError."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, cap: float | None = None) -> float:
        left = max(0.0, self.end - time.monotonic())
        return left if cap is None else min(left, cap)


@contextlib.contextmanager
def step(report: Report, name: str) -> Iterator[None]:
    """A named step: printed, timed, and recorded as failed (with the reason) rather than
    ending the run."""
    say(f"== {name}")
    t0 = time.monotonic()
    try:
        yield
        say(f"== {name}: done in {time.monotonic() - t0:.1f} s")
    except Exception as exc:
        reason = (
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        )
        report.failures.append(f"{name}: {reason}")
        say(f"== {name}: FAILED after {time.monotonic() - t0:.1f} s: {reason}")
        traceback.print_exc()


# -- 1. environment ----------------------------------------------------------------------------


def cuda_devices() -> list[str] | None:
    """The CUDA devices torch sees, or None when there is no torch with CUDA here."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def missing_modules() -> list[str]:
    return [m for m in SERVICE_MODULES if importlib.util.find_spec(m) is None]


def wheel_dirs() -> list[Path]:
    """$GPU_WHEELS's folders, .whl/ and its subfolders (`make gpu-wheels`: .whl/a, .whl/b)."""
    named = [Path(p) for p in os.environ.get("GPU_WHEELS", "").split(":") if p]
    local = ROOT / ".whl"
    mine = [local, *sorted(d for d in local.iterdir() if d.is_dir())] if local.is_dir() else []
    return [d for d in [*named, *mine] if d.is_dir()]


def gather_wheels(folders: list[Path], into: Path) -> list[Path]:
    """The wheels in `folders`, with `X.whl.part00`, `X.whl.part01`... (from any of them)
    joined into `into`/X.whl: a wheel too big for one transfer travels in parts, maybe
    in different transfers (`make gpu-wheels`)."""
    wheels: dict[str, Path] = {}
    parts: dict[str, list[Path]] = {}
    for folder in folders:
        wheels.update({w.name: w for w in folder.glob("*.whl")})
        for part in folder.glob("*.whl.part*"):
            parts.setdefault(part.name.rsplit(".part", 1)[0], []).append(part)
    for name, pieces in parts.items():
        whole = into / name
        with whole.open("wb") as out:
            for piece in sorted(pieces, key=lambda p: p.name):
                out.write(piece.read_bytes())
        wheels[name] = whole
    return sorted(wheels.values(), key=lambda w: w.name)


def install_missing(missing: list[str], deadline: Deadline) -> str:
    """Install what the service lacks into .gpu-site/ (then importable here and in the Ray
    workers, through PYTHONPATH); says how."""
    SITE.mkdir(exist_ok=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--target", str(SITE)]
    wheels = gather_wheels(wheel_dirs(), Path(tempfile.mkdtemp(prefix="gpu-wheels-")))
    if wheels:
        argv = [*pip, "--no-index", "--no-deps", *map(str, wheels)]
        how = f"{len(wheels)} wheels from {', '.join(map(str, wheel_dirs()))}"
    else:
        names = sorted({SERVICE_MODULES[m] for m in missing})
        argv = [*pip, "--retries", "0", "--timeout", "10", *names]
        how = f"from the package index: {' '.join(names)}"
    say(f"installing into {SITE}: {how}")
    subprocess.run(argv, check=True, timeout=deadline.left(300))
    return how


def use_site() -> None:
    """Make .gpu-site/ importable here and in every process Ray starts from here."""
    if SITE.is_dir():
        sys.path.insert(0, str(SITE))
        importlib.invalidate_caches()
    paths = [str(ROOT), *([str(SITE)] if SITE.is_dir() else [])]
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))


# -- 2. plain torchrun -------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    params: dict[str, Any]
    global_batch: int
    micro_batch: int
    steps: int
    checkpoint_every: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.params["seq_len"]

    def flops_per_step(self) -> float:
        key = json.dumps(self.params, sort_keys=True)
        if key not in _FLOPS_PER_SAMPLE:  # builds the model: once
            from elastrain.contracts.workload_params import GptParams
            from elastrain.workers.workloads.gpt import build

            per_sample = build(GptParams.model_validate(self.params)).flops_per_sample
            assert per_sample is not None
            _FLOPS_PER_SAMPLE[key] = per_sample
        return _FLOPS_PER_SAMPLE[key] * self.global_batch


_FLOPS_PER_SAMPLE: dict[str, float] = {}


def peak(device_name: str) -> float | None:
    from elastrain.workers.flops import peak_flops

    return peak_flops(device_name, "bf16", os.environ.get("ELASTRAIN_PEAK_FLOPS"))[0]


def rates(step_s: float, shape: Shape, gpus: int, device: str) -> tuple[float, float | None]:
    """(tokens/s, MFU) of a step time."""
    top = peak(device)
    mfu = shape.flops_per_step() / step_s / (gpus * top) if top else None
    return shape.tokens_per_step / step_s, mfu


def plain_torchrun(strategy: str, shape: Shape, gpus: int, deadline: Deadline,
                   *, sync_every_step: bool = False, compiled: bool = False) -> float:  # fmt: skip
    """The mean step time (s) of the plain script, after its warm-up steps."""
    on_cpu = gpu_on_cpu()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={gpus}", str(ROOT / "bench" / "plain_torchrun.py"),
            "--strategy", strategy, "--device", "cpu" if on_cpu else "cuda",
            "--precision", "fp32" if on_cpu else "bf16",
            "--steps", str(shape.steps + WARMUP_STEPS), "--params", json.dumps(shape.params),
            "--global-batch", str(shape.global_batch), "--micro-batch", str(shape.micro_batch),
            "--out", str(out), *(["--sync-every-step"] if sync_every_step else []),
            *(["--compile"] if compiled else []),
        ]  # fmt: skip
        say(" ".join(argv[1:]))
        subprocess.run(argv, check=True, timeout=deadline.left(300), cwd=ROOT)
        times = json.loads(out.read_text())[WARMUP_STEPS:]
    # The span over the steps (the last stamped after a synchronize): the CPU runs ahead
    # of the GPU, so single intervals are launch times, not step times.
    return (times[-1] - times[0]) / (len(times) - 1)


# -- 3, 4. the service -------------------------------------------------------------------------


def job_spec(name: str, strategy: str, shape: Shape, gpus: int, *, async_save: bool,
             max_steps: int = 1_000_000, compiled: bool = False) -> dict[str, Any]:  # fmt: skip
    return {
        "name": name,
        "workload": {"name": "gpt", "params": shape.params},
        "strategy": {"kind": strategy, "mixed_precision": None if gpu_on_cpu() else "bf16"},
        "scaling": {"min_workers": 1, "max_workers": gpus, "use_gpu": True,
                    "gpus_per_worker": 1, "cpus_per_worker": 1},
        "training": {"global_batch_size": shape.global_batch,
                     "micro_batch_size": shape.micro_batch, "learning_rate": 3e-4,
                     "max_steps": max_steps, "seed": 0, "compile": compiled},
        "checkpoint": {"every_steps": shape.checkpoint_every, "keep_last": 2,
                       "async_save": async_save},
        "failure": {"max_restarts": 5},
    }  # fmt: skip


class Service:
    """The service under test, seen over its REST API (and the runtime actor for the
    pool's processes and the forced recovery)."""

    def __init__(self, client: Any, namespace: str) -> None:
        self.client = client
        self.namespace = namespace

    def get(self, path: str) -> Any:
        return self.client.get(path).json()

    def submit(self, spec: dict[str, Any]) -> int:
        resp = self.client.post("/v1/jobs", json=spec)
        if resp.status_code != 201:
            raise RuntimeError(f"submit {spec['name']}: {resp.status_code} {resp.text[:300]}")
        return int(resp.json()["id"])

    def wait(self, what: str, done: Callable[[], Any], deadline: Deadline, cap: float) -> Any:
        end = time.monotonic() + deadline.left(cap)
        while time.monotonic() < end:
            value = done()
            if value:
                return value
            time.sleep(0.3)
        raise TimeoutError(f"not within {cap:g} s (or the time limit): {what}")

    def job(self, job_id: int) -> dict[str, Any]:
        return dict(self.get(f"/v1/jobs/{job_id}"))

    def training(self, job_id: int, attempt: int, step: int, deadline: Deadline) -> None:
        def there() -> bool:
            job = self.job(job_id)
            if job["state"] in ("FAILED", "CANCELLED", "SUCCEEDED") and job["step"] < step:
                raise RuntimeError(f"job {job_id} ended {job['state']}: {job.get('error')}")
            return job["state"] == "RUNNING" and job["attempt"] >= attempt and job["step"] >= step

        self.wait(f"job {job_id} attempt {attempt} at step {step}", there, deadline, 300)

    def events(self, job_id: int, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.get(f"/v1/jobs/{job_id}/events") if e["kind"] == kind]

    def metrics(self, job_id: int) -> list[dict[str, Any]]:
        return list(self.get(f"/v1/jobs/{job_id}/metrics"))

    def pids(self, job_id: int, attempt: int) -> set[int]:
        placed = [e for e in self.events(job_id, "placement") if e["attempt"] == attempt]
        return {int(p) for p in placed[-1]["details"]["pids"].values()} if placed else set()

    def pool(self) -> list[Any]:
        import ray

        from elastrain.contracts.runtime import RUNTIME_NAME

        runtime = ray.get_actor(RUNTIME_NAME, namespace=self.namespace)
        return list(ray.get(runtime.workers.remote(self.token()), timeout=30))

    def token(self) -> str:
        """The control plane's token: the runtime answers no one else."""
        from elastrain.service.identity import runtime_control_token

        return runtime_control_token(self.client.app.state.session_factory)

    def release(self, job_id: int, attempt: int) -> None:
        """A forced recovery that kills nothing: the runtime lets go of the attempt, the
        control plane sees it lost and launches the next on the same processes."""
        import ray

        from elastrain.contracts.runtime import RUNTIME_NAME, AttemptKey

        runtime = ray.get_actor(RUNTIME_NAME, namespace=self.namespace)
        ray.get(runtime.release.remote(self.token(), AttemptKey(job_id, attempt)), timeout=30)

    def cancel(self, job_id: int, deadline: Deadline) -> None:
        self.client.post(f"/v1/jobs/{job_id}/cancel")
        self.wait(f"job {job_id} ends", lambda: self.job(job_id)["state"] in
                  ("CANCELLED", "SUCCEEDED", "FAILED"), deadline, 120)  # fmt: skip


def step_walls(points: list[dict[str, Any]], attempt: int) -> dict[int, float]:
    """Wall time (s) from the previous step's end to each step's end, for an attempt's
    steps after its first few: what a step costs, the loop's own work between steps and
    any checkpoint save included."""
    ends = {p["step"]: float(p["wall_time"]) for p in points if p["attempt"] == attempt}
    return {s: ends[s] - ends[s - 1] for s in sorted(ends)
            if s - 1 in ends and s > min(ends) + WARMUP_STEPS}  # fmt: skip


def steady_step_s(points: list[dict[str, Any]], attempt: int) -> float:
    """The median step time of an attempt (a checkpoint's steps are the rare outliers)."""
    walls = list(step_walls(points, attempt).values())
    if len(walls) < 3:
        raise RuntimeError(f"attempt {attempt}: only {len(walls)} steady steps reported")
    return statistics.median(walls)


def timeline_of(svc: Service, job_id: int, attempt: int) -> tuple[str, dict[str, float]]:
    for e in svc.events(job_id, "timeline"):
        if e["attempt"] == attempt:
            details = e["details"]
            phases = {p["phase"]: float(p["seconds"]) for p in details["phases"]}
            return details["cause"], phases | {"total": float(details["total_s"])}
    raise RuntimeError(f"job {job_id} attempt {attempt}: no timeline event")


def restore_source(svc: Service, job_id: int, attempt: int) -> str:
    resumed = [e for e in svc.events(job_id, "resumed") if e["attempt"] == attempt]
    return str(resumed[-1]["details"].get("source") or "checkpoint") if resumed else "fresh"


def throughput_step_s(points: list[dict[str, Any]], attempt: int, every: int) -> float:
    """The mean step time of an attempt, as the plain script's is taken (a span over its
    steps), leaving out the steps a checkpoint touched (the three after each save): the
    plain script saves none, and the checkpoint's cost is measured on its own."""
    walls = [w for s, w in step_walls(points, attempt).items() if s % every not in (1, 2, 3)]
    if len(walls) < 3:
        raise RuntimeError(f"attempt {attempt}: only {len(walls)} steady steps reported")
    return statistics.fmean(walls)


def checkpoint_costs(points: list[dict[str, Any]], attempt: int, every: int) -> tuple[float, float]:
    """(median stall, median whole cost) per checkpoint. The stall: the seconds the loop
    was blocked by the save (`checkpoint_stall_s`, reported with the steps after it). The
    whole cost: how much longer the `every` steps after the save took than steady steps
    (the stall, and for an async save its background copy and write competing with
    training)."""
    walls = step_walls(points, attempt)
    steady = steady_step_s(points, attempt)
    stall_of = {p["step"]: float(p.get("checkpoint_stall_s") or 0.0)
                for p in points if p["attempt"] == attempt}  # fmt: skip
    stalls, wholes = [], []
    for saved in sorted(s for s in stall_of if s % every == 0):
        after = range(saved + 1, saved + every)
        if not all(s in walls for s in after):
            continue
        stalls.append(sum(stall_of[s] for s in after))
        wholes.append(sum(walls[s] - steady for s in after))
    if not stalls:
        raise RuntimeError(f"attempt {attempt}: no checkpoint with every step after it")
    return statistics.median(stalls), statistics.median(wholes)


def run_job(svc: Service, report: Report, strategy: str, shape: Shape, gpus: int,
            device: str, deadline: Deadline, *, kill: bool) -> None:  # fmt: skip
    import signal as signals

    label = f"{strategy} {'fp32 on CPU' if gpu_on_cpu() else 'bf16'}"

    def warm_gpu_processes() -> set[int]:  # one per GPU, each answering and idle
        owners = [w for w in svc.pool() if w.gpu is not None]
        idle = {w.pid for w in owners if not w.busy}
        return idle if len(owners) == len(idle) == gpus else set()

    gpu_pids = svc.wait(f"{gpus} idle GPU processes", warm_gpu_processes, deadline, 180)
    job = svc.submit(job_spec(f"gpu-{strategy}", strategy, shape, gpus, async_save=True))
    measured_to = WARMUP_STEPS + shape.steps
    svc.training(job, 1, measured_to, deadline)
    first = svc.pids(job, 1)
    report.check(f"{label}: the first start ran in warm GPU processes", first <= gpu_pids,
                 f"(pids {sorted(first)}; pool's GPU processes {sorted(gpu_pids)})")  # fmt: skip
    points = svc.metrics(job)
    step_s = throughput_step_s(points, 1, shape.checkpoint_every)
    tokens, mfu = rates(step_s, shape, len(first), device)
    report.throughput.append((label, "service", tokens, mfu))
    inside = statistics.median(float(p["step_time_s"]) for p in points
                               if p["attempt"] == 1 and p["step"] > WARMUP_STEPS + 1
                               and p.get("step_time_s") is not None)  # fmt: skip
    report.environment.append(
        f"{label}: a steady step {steady_step_s(points, 1) * 1e3:.1f} ms from end to end, of "
        f"which the strategy's step (forward, backward, agreement, update) "
        f"{inside * 1e3:.1f} ms (medians)"
    )
    report.timelines.append((label, *timeline_of(svc, job, 1), restore_source(svc, job, 1)))
    stall, whole = checkpoint_costs(points, 1, shape.checkpoint_every)
    report.checkpoints += [(label, "async save: stall per checkpoint", stall),
                           (label, "async save: whole cost per checkpoint", whole)]  # fmt: skip

    # Forced recovery without a death: the same processes, the state from their memory.
    at = svc.job(job)["step"]
    svc.release(job, 1)
    svc.training(job, 2, at + 2, deadline)
    report.timelines.append((f"{label}, attempt released", *timeline_of(svc, job, 2),
                             restore_source(svc, job, 2)))  # fmt: skip
    report.check(f"{label}: the recovery kept the processes", svc.pids(job, 2) == first,
                 f"(attempt 2 pids {sorted(svc.pids(job, 2))})")  # fmt: skip
    if kill:
        at = svc.job(job)["step"]
        victim = max(svc.pids(job, 2))
        say(f"killing the GPU process {victim} of job {job}")
        os.kill(victim, signals.SIGKILL)
        svc.training(job, 3, at + 2, deadline)
        report.timelines.append((f"{label}, process killed", *timeline_of(svc, job, 3),
                                 restore_source(svc, job, 3)))  # fmt: skip
    svc.cancel(job, deadline)
    # The same job saving synchronously: the reference for the async save's cost.
    sync_steps = 3 * shape.checkpoint_every + WARMUP_STEPS + 1
    ref = svc.submit(job_spec(f"gpu-{strategy}-sync", strategy, shape, gpus, async_save=False,
                              max_steps=sync_steps))  # fmt: skip
    svc.wait(f"job {ref} done", lambda: svc.job(ref)["state"] == "SUCCEEDED", deadline, 300)
    sync_stall, sync_whole = checkpoint_costs(svc.metrics(ref), 1, shape.checkpoint_every)
    report.checkpoints += [(label, "sync save: stall per checkpoint", sync_stall),
                           (label, "sync save: whole cost per checkpoint", sync_whole)]  # fmt: skip
    for what, mine in (("stall", stall), ("whole cost", whole)):
        ratio = mine / sync_stall if sync_stall > 0 else float("inf")
        report.check(f"{label}: async save's {what} <= 5 % of a sync save",
                     ratio <= 0.05, f"({ratio:.1%} of the sync stall)")  # fmt: skip


def service_checks(report: Report, shape: Shape, gpus: int, device: str,
                   deadline: Deadline) -> None:  # fmt: skip
    from tests.integration.ray_service import ray_service

    with tempfile.TemporaryDirectory() as tmp, ray_service(
        Path(tmp),
        num_cpus=max(2, min(os.cpu_count() or 2, 2 * gpus + 2)),
        num_gpus=gpus if gpu_on_cpu() else None,
        allowed_hosts=["testserver"],
        warm_workers_per_node=1,
        restart_backoff_s=0,
        # A rank a step ahead of a released peer can block in a collective until this
        # timeout (issue 25, item 4); the next attempt waits 5 + 15 s for its process.
        collective_timeout_s=30,
    ) as client:  # fmt: skip
        svc = Service(client, "elastrain-test")
        t0 = time.monotonic()
        svc.wait(f"{gpus} warm GPU processes", lambda: len(
            [w for w in svc.pool() if w.gpu is not None and not w.busy]) >= gpus, deadline, 180)  # fmt: skip
        report.environment.append(
            f"Pool: {gpus} GPU process(es) warm {time.monotonic() - t0:.1f} s after the "
            f"service started: " + "; ".join(sorted({w.device for w in svc.pool() if w.gpu is not None}))
        )  # fmt: skip
        for strategy in ("ddp", "fsdp"):
            with step(report, f"service: {strategy} bf16 job"):
                run_job(svc, report, strategy, shape, gpus, device, deadline,
                        kill=strategy == "ddp")  # fmt: skip
        for strategy in ("ddp", "fsdp"):
            with step(report, f"service: {strategy} bf16 job, training.compile"):
                compiled_throughput(svc, report, strategy, shape, gpus, device, deadline)
        keep_profiles(Path(tmp))


def compiled_throughput(svc: Service, report: Report, strategy: str, shape: Shape, gpus: int,
                        device: str, deadline: Deadline) -> None:  # fmt: skip
    """Tokens/s of the job with `training.compile: true` (its first steps compile)."""
    label = f"{strategy} {'fp32 on CPU' if gpu_on_cpu() else 'bf16'} compiled"
    job = svc.submit(job_spec(f"gpu-{strategy}-compiled", strategy, shape, gpus,
                              async_save=True, compiled=True))  # fmt: skip
    svc.training(job, 1, WARMUP_STEPS + shape.steps, deadline)
    points = svc.metrics(job)
    step_s = throughput_step_s(points, 1, shape.checkpoint_every)
    report.throughput.append((label, "service", *rates(step_s, shape, gpus, device)))
    svc.cancel(job, deadline)


def keep_profiles(root: Path) -> None:
    """Step profiles the jobs wrote (`ELASTRAIN_PROFILE_STEPS`, `workers/profiling.py`)
    into one file beside the report, before the service's storage goes."""
    found = sorted(root.rglob("jobs/*/profile/*.txt"))
    if found:
        PROFILES.parent.mkdir(exist_ok=True)
        PROFILES.write_text(
            "\n\n".join(f"== {p.relative_to(root)}\n{p.read_text()}" for p in found)
        )
        say(f"{len(found)} step profiles -> {PROFILES}")


# -- 5. the report -----------------------------------------------------------------------------


def render(report: Report, command: str) -> str:
    lines = [
        "# GPU check",
        "",
        f"`{command}` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(report.started))}, "
        f"{time.time() - report.started:.0f} s"
        + (" (--quick: small sizes, not figures)" if report.quick else ""),
        "",
        *[f"- {line}" for line in report.environment],
        "",
    ]
    if report.checks:
        lines += ["| check | | |", "| --- | --- | --- |"]
        lines += [f"| {w} | {'met' if ok else '**not met**'} | {d} |" for w, ok, d in report.checks]
        lines.append("")
    if report.throughput:
        lines += ["## Throughput", "",
                  "| job | plain torchrun tokens/s | service tokens/s | ratio (target >= 0.98) "
                  "| plain MFU | service MFU | plain with a host sync per step: tokens/s |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for label in dict.fromkeys(t[0] for t in report.throughput):
            got = {who: (tok, mfu) for lab, who, tok, mfu in report.throughput if lab == label}
            plain, served = got.get("plain", (None, None)), got.get("service", (None, None))
            synced = got.get("synced", (None, None))
            ratio = served[0] / plain[0] if plain[0] and served[0] else None
            lines.append(f"| {label} | {_num(plain[0])} | {_num(served[0])} | {_ratio(ratio)} "
                         f"| {_pct(plain[1])} | {_pct(served[1])} | {_num(synced[0])} |")  # fmt: skip
        lines.append("")
    if report.timelines:
        phases = ["old_group_stopped", "placed", "processes_up", "group_formed",
                  "state_restored", "first_step", "total"]  # fmt: skip
        lines += ["## Start and recovery timelines", "",
                  "Seconds each phase took (since the phase before it; `total`: from the "
                  "decision to the first step), from the job's Timeline events.", "",
                  "| job | cause | " + " | ".join(phases) + " | state from |",
                  "| --- | --- | " + " | ".join("---:" for _ in phases) + " | --- |"]  # fmt: skip
        for label, cause, marks, source in report.timelines:
            cells = " | ".join(f"{marks[p]:.2f}" if p in marks else "" for p in phases)
            lines.append(f"| {label} | {cause} | {cells} | {source} |")
        lines.append("")
    if report.checkpoints:
        lines += ["## Checkpoints", "", "| job | what | seconds |", "| --- | --- | ---: |"]
        lines += [f"| {label} | {what} | {s:.3f} |" for label, what, s in report.checkpoints]
        lines.append("")
    lines += ["## What failed", ""]
    lines += [f"- {f}" for f in report.failures] or ["- nothing"]
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return f"{x:,.0f}" if x is not None else ""


def _pct(x: float | None) -> str:
    return f"{x:.1%}" if x is not None else ""


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}" + ("" if x >= 0.98 else " (not met)")


def write(out: Path, block: str) -> None:
    from bench.report_blocks import write_block

    write_block(out, MARK, block, new_document="")
    say(f"wrote {out}")


# -- main --------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small model, few steps")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench-gpu.md")
    parser.add_argument("--time-limit", type=float, default=480.0, help="seconds, all steps")
    parser.add_argument("--skip-service", action="store_true", help="plain torchrun only")
    parser.add_argument(
        "--sync-reference", action="store_true",
        help="also run the plain script with a host sync per step (as the service's step "
        "agreement makes): what that sync alone costs",
    )  # fmt: skip
    parser.add_argument(
        "--test-on-cpu", type=int, metavar="GPUS", default=0,
        help=f"test-only: pretend GPUS GPUs ({TEST_GPU_ON_CPU}: ranks on CPU, gloo, fp32) "
        "to try this script where there is no GPU; its numbers mean nothing",
    )  # fmt: skip
    args = parser.parse_args()
    if args.test_on_cpu:
        os.environ[TEST_GPU_ON_CPU] = "1"  # before Ray starts: its workers inherit it
    command = "python bench/gpu_check.py" + (" --quick" if args.quick else "")
    report = Report(quick=args.quick)
    deadline = Deadline(args.time_limit)

    def out_of_time(signum: int, frame: Any) -> None:
        raise TimeoutError(f"--time-limit {args.time_limit:g} s reached")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(int(args.time_limit) + 30)  # the backstop for a call that never returns

    devices = [f"cpu ({TEST_GPU_ON_CPU})"] * args.test_on_cpu or cuda_devices()
    report.environment.append(
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    if not devices:
        why = "no torch" if importlib.util.find_spec("torch") is None else "torch sees no CUDA"
        say(f"no GPU: skipped, nothing measured ({why})")
        if args.quick:  # bench/all.py's temp copy: says so; the real document stays
            write(args.out, f"| GPU check | |\n| --- | --- |\n| no GPU on this machine ({why}) "
                  "| skipped, nothing measured |")  # fmt: skip
        return 0
    import torch

    gpus = len(devices)
    if args.test_on_cpu:
        command += f" --test-on-cpu {args.test_on_cpu}"
        report.environment.append(f"**{TEST_GPU_ON_CPU}: ranks on the CPU; not figures**")
    report.environment.append(f"GPUs: {gpus} x {devices[0]}; torch {torch.__version__}, "
                              f"CUDA {torch.version.cuda}")  # fmt: skip
    shape = Shape(*(QUICK if args.quick else FULL))
    report.environment.append(
        f"Model: gpt {shape.params}, global batch {shape.global_batch} x {shape.params['seq_len']} "
        f"tokens, micro-batch {shape.micro_batch}, bf16, {shape.steps} measured steps after "
        f"{WARMUP_STEPS}; checkpoint every {shape.checkpoint_every} steps"
    )  # fmt: skip
    if gpus == 1:
        report.environment.append(
            "One GPU: jobs run at world size 1; the killed process has no surviving peer "
            "(its recovery restores from the checkpoint) and no resize is possible."
        )
    try:
        with step(report, "environment: the service's packages"):
            missing = missing_modules()
            if missing and not args.skip_service:
                how = install_missing(missing, deadline)
                use_site()
                still = missing_modules()
                report.environment.append(f"Installed into .gpu-site/: {how}")
                if still:
                    raise RuntimeError(f"still missing: {', '.join(still)}")
            else:
                use_site()
        for strategy in ("ddp", "fsdp"):
            with step(report, f"plain torchrun: {strategy} bf16"):
                step_s = plain_torchrun(strategy, shape, gpus, deadline)
                label = f"{strategy} {'fp32 on CPU' if gpu_on_cpu() else 'bf16'}"
                report.throughput.append((label, "plain", *rates(step_s, shape, gpus, devices[0])))
            with step(report, f"plain torchrun: {strategy} bf16, compiled blocks"):
                step_s = plain_torchrun(strategy, shape, gpus, deadline, compiled=True)
                report.throughput.append(
                    (f"{label} compiled", "plain", *rates(step_s, shape, gpus, devices[0]))
                )
            if not args.sync_reference:
                continue
            with step(report, f"plain torchrun, a host sync per step: {strategy} bf16"):
                step_s = plain_torchrun(strategy, shape, gpus, deadline, sync_every_step=True)
                report.throughput.append((label, "synced", *rates(step_s, shape, gpus, devices[0])))
        if args.skip_service:
            report.failures.append("service: not run (--skip-service)")
        elif not any(f.startswith("environment") for f in report.failures):
            with step(report, "service"):
                service_checks(report, shape, gpus, devices[0], deadline)
        else:
            report.failures.append("service: not run (its packages are missing)")
    except TimeoutError as exc:  # the alarm, outside any step
        report.failures.append(str(exc))
    finally:
        signal.alarm(0)
        write(args.out, render(report, command))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
