"""Start, node loss and node return: elastrain vs plain Ray Train elastic vs bare torchrun.

A `ray.cluster_utils.Cluster` with a CPU-less head and 3 worker nodes of 1 CPU each. A
`gpt` job (min 1, max 3 workers, DDP, checkpoint every 5 steps) is submitted on the idle
cluster; once it is past step 10 the node holding rank 2 is removed, and later a node is
added back. Measured per trial (times end at the wall clock of an optimizer step):

- submit -> the first optimizer step (trial 0: the service's first job; later trials: a
  job submitted right after the previous one ended);
- node removed -> the first step after the resume (at world size 2);
- node added -> the first step at world size 3; node joined (its raylet registered) -> the
  first step at world size 3 and -> the grow decision; and the decision -> the first step at
  world size 3;
- steps recomputed per node loss: the last step done before the loss minus the step the
  resume started from (0 when the state came from the survivors' memory);
- node drained (`POST /v1/cluster/nodes/{id}/drain`, deadline 30 s, on the grown job's
  rank 2) -> the first step at world size 2, the steps recomputed and restarts counted;
  beside the node loss: leaving before the node goes vs after it went. Ray Train gets the
  same drain from Ray's own drain API (reason preemption, as the autoscaler, KubeRay or a
  preemption notice sends it), and the node goes at the deadline;
- the timeline of every start (detected, old group stopped, placed, processes up, process
  group formed, state restored, first step; a grow's from its node joined and process warm),
  from the job's events.

The Ray Train baseline runs the very same training loop (`elastrain.workers.loop.train`, same
checkpoints) under `TorchTrainer` with `ScalingConfig(num_workers=(1, 3))` and
`FailureConfig(max_failures=-1)`, Ray Train's own elastic restarts, with the resize monitor
interval at 5 s (default 60 s) and every other setting at its default. The torchrun
baseline starts the same loop with `torchrun --standalone --nproc_per_node 3` on this
machine (no Ray) and measures launch -> first step.

    .venv/bin/python bench/elastic_bench.py [--repeats 5] [--baseline-repeats 5]

The report goes between its markers in `--out` (docs/bench-elastic.md): the notes written
around them stay. `bench/all.py --quick` runs it with one trial of each and Ray Train's
worker-group start timeout lowered (`--ray-train-start-timeout`), to check that it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray
from ray.cluster_utils import Cluster

from bench.report_blocks import write_block
from elastrain.contracts.messages import Phase
from elastrain.contracts.spec import JobSpec
from tests.integration.cluster_service import Nodes, multi_node_service
from tests.integration.ray_service import submit, tiny_gpt_spec, wait_for, wait_terminal

GROW_INTERVAL_S = 2.0
WORKERS = 3
SPEC = tiny_gpt_spec(
    "elastic-bench",
    scaling={"min_workers": 1, "max_workers": WORKERS, "cpus_per_worker": 1},
    training={"global_batch_size": 24, "micro_batch_size": 8, "max_steps": 100000},
    checkpoint={"every_steps": 5, "keep_last": 2, "async_save": False},
    failure={"max_restarts": 3},
)
PHASES = [p.value for p in Phase]
#: What started each attempt of a trial's job (its timeline's column).
ATTEMPT_CAUSES = {1: "submitted", 2: "node lost", 3: "node back", 4: "drained"}
#: The service's settings. Its API answers only the Host names it is configured for
#: (ELASTRAIN_ALLOWED_HOSTS), as a user's server is told its own; Starlette's TestClient
#: sends `Host: testserver`.
SERVICE = {"grow_interval_s": GROW_INTERVAL_S, "allowed_hosts": ["testserver"]}
#: Ray Train's own knob for how long a worker group waits for its placement group (Ray's
#: default 60 s); read by the Train controller, a process the raylets start, hence the env.
RAY_TRAIN_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


# -- elastrain ------------------------------------------------------------------------------


def _metrics(client: Any, job_id: int) -> list[dict[str, Any]]:
    return client.get(f"/v1/jobs/{job_id}/metrics").json()


def _events(client: Any, job_id: int) -> list[dict[str, Any]]:
    return client.get(f"/v1/jobs/{job_id}/events").json()


def _epoch(iso: str) -> float:
    moment = datetime.fromisoformat(iso)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _first_point(client: Any, job_id: int, attempt: int, timeout: float = 60) -> dict[str, Any]:
    """The attempt's first step. Metrics reach the API in batches, in order, shortly after
    the job shows RUNNING: wait for the attempt's first batch."""
    points = _wait(
        lambda: [p for p in _metrics(client, job_id) if p["attempt"] == attempt],
        timeout,
        f"job {job_id} attempt {attempt}'s first step",
    )
    return min(points, key=lambda p: p["step"])


def wait_for_warm_pool(client: Any, minimum: int, timeout: float = 120) -> None:
    from elastrain.service.identity import runtime_control_token

    runtime = ray.get_actor("elastrain-runtime")
    token = runtime_control_token(client.app.state.session_factory)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        idle = [w for w in ray.get(runtime.workers.remote(token)) if not w.busy]
        if len(idle) >= minimum:
            return
        time.sleep(0.5)
    raise TimeoutError("warm pool")


def elastrain_trial(
    client: Any, nodes: Nodes
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    t_submit = time.time()
    job_id = submit(client, SPEC)
    wait_for(client, job_id, lambda j: j["state"] == "RUNNING" and j["step"] >= 10, what="step 10")
    started = _first_point(client, job_id, 1)
    placement = next(
        e["details"]["ranks"] for e in _events(client, job_id) if e["kind"] == "placement"
    )
    t_remove = time.time()
    nodes.remove(nodes.node_of(placement["2"]))
    wait_for(
        client, job_id, lambda j: j["attempt"] == 2 and j["state"] == "RUNNING", what="resumed"
    )
    resumed = _first_point(client, job_id, 2)
    t_add = time.time()
    nodes.add(1)
    t_joined = time.time()  # the new raylet is registered (`Cluster.wait_for_nodes`)
    wait_for(client, job_id, lambda j: j["attempt"] == 3 and j["state"] == "RUNNING",
             what="grown", timeout=300)  # fmt: skip
    grown = _first_point(client, job_id, 3)
    drained = _drain_trial(client, job_id)
    client.post(f"/v1/jobs/{job_id}/cancel")
    wait_terminal(client, job_id, timeout=120)

    events = _events(client, job_id)
    lost_step = next(e["details"]["step"] for e in events if e["kind"] == "node_lost")
    resumed_event = next(e["details"] for e in events if e["kind"] == "resumed")
    resumed_step = resumed_event["step"]
    t_decision = next(_epoch(e["at"]) for e in events if e["to_state"] == "RESIZING")
    # Each phase's seconds since the previous mark; the first mark (where the clock starts:
    # the decision, or the node's join for a grow) has none. By attempt: the grow and the
    # drain are both a "resize".
    timelines = {
        ATTEMPT_CAUSES[e["attempt"]]: {p["phase"]: p["seconds"] for p in e["details"]["phases"][1:]}
        | {"total": e["details"]["total_s"]}
        for e in events
        if e["kind"] == "timeline" and e["attempt"] in ATTEMPT_CAUSES
    }
    trial = {
        "submit_to_step_s": started["wall_time"] - t_submit,
        "loss_to_step_s": resumed["wall_time"] - t_remove,
        "join_to_decision_s": t_decision - t_joined,
        "decision_to_step_s": grown["wall_time"] - t_decision,
        "add_to_step_s": grown["wall_time"] - t_add,
        "join_to_step_s": grown["wall_time"] - t_joined,
        "recomputed_steps": max(0, lost_step - resumed_step),
        "restored_from_peer": float(resumed_event["source"] == "peer"),
        "world_after_loss": resumed["world_size"],
        "world_after_add": grown["world_size"],
        **drained,
    }
    return trial, timelines


def _drain_trial(client: Any, job_id: int) -> dict[str, float]:
    """Drain the node of rank 2 of the grown attempt (3) with a 30 s deadline: the job
    leaves it at a step boundary; measured to the first step of attempt 4, at world size
    2, with the steps it recomputed and the restarts it counted. Undrained after."""
    ranks = next(
        e["details"]["ranks"]
        for e in _events(client, job_id)
        if e["kind"] == "placement" and e["attempt"] == 3
    )
    node = ranks["2"]
    restarts_before = client.get(f"/v1/jobs/{job_id}").json()["restarts"]
    t_drain = time.time()
    answer = client.post(
        f"/v1/cluster/nodes/{node}/drain", json={"deadline_s": DRAIN_DEADLINE_S, "reason": "bench"}
    )
    assert answer.status_code == 200, answer.text
    wait_for(client, job_id, lambda j: j["attempt"] == 4 and j["state"] == "RUNNING",
             what="off the drained node", timeout=120)  # fmt: skip
    left = _first_point(client, job_id, 4)
    client.post(f"/v1/cluster/nodes/{node}/undrain")
    last = max(p["step"] for p in _metrics(client, job_id) if p["attempt"] == 3)
    resumed = next(
        e["details"]
        for e in _events(client, job_id)
        if e["kind"] == "resumed" and e["attempt"] == 4
    )
    return {
        "drain_to_step_s": left["wall_time"] - t_drain,
        "drain_recomputed_steps": max(0, last - resumed["step"]),
        "drain_restarts": client.get(f"/v1/jobs/{job_id}").json()["restarts"] - restarts_before,
        "drain_from_peer": float(resumed["source"] == "peer"),
        "world_after_drain": left["world_size"],
    }


def loss_curves(client: Any, nodes: Nodes, steps: int = 40) -> list[tuple[int, float, float, int]]:
    """(step, interrupted loss, uninterrupted loss, world size of the interrupted run)."""
    spec = {**SPEC, "training": {**SPEC["training"], "max_steps": steps}}
    interrupted = submit(client, {**spec, "name": "curve-interrupted"})
    wait_for(
        client, interrupted, lambda j: j["state"] == "RUNNING" and j["step"] >= 12, what="step 12"
    )
    placement = next(
        e["details"]["ranks"]
        for e in client.get(f"/v1/jobs/{interrupted}/events").json()
        if e["kind"] == "placement"
    )
    nodes.remove(nodes.node_of(placement["2"]))
    wait_for(
        # Resumed, or already done: 40 steps take a few seconds once it resumed.
        client,
        interrupted,
        lambda j: j["attempt"] >= 2,
        what="resumed",
    )
    nodes.add(1)
    assert wait_terminal(client, interrupted, timeout=600)["state"] == "SUCCEEDED"
    steady = submit(client, {**spec, "name": "curve-steady"})
    assert wait_terminal(client, steady, timeout=600)["state"] == "SUCCEEDED"
    a = {p["step"]: p for p in _metrics(client, interrupted)}
    b = {p["step"]: p for p in _metrics(client, steady)}
    return [(s, a[s]["loss"], b[s]["loss"], a[s]["world_size"]) for s in sorted(b)]


# -- plain Ray Train elastic ------------------------------------------------------------------


def _baseline_loop(config: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from elastrain.workers.api import TrainContext
    from elastrain.workers.loop import train

    sys.path.insert(0, config["bench_dir"])  # this runs in a Ray worker process
    from step_log import FileHooks, SilentHooks

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    folder = Path(config["folder"])
    nodes: list[Any] = [None] * ctx.get_world_size()
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    if ctx.get_world_rank() == 0:
        (folder / f"placement-{time.time():.3f}.json").write_text(json.dumps(nodes))
    train_ctx = TrainContext(
        rank=ctx.get_world_rank(),
        world_size=ctx.get_world_size(),
        local_rank=ctx.get_local_rank(),
        device=torch.device("cpu"),
        job_id=0,
        attempt=int(time.time() * 10) % (1 << 30),  # increasing across restarts
        checkpoint_root=folder / "checkpoints",
    )
    hooks = FileHooks(folder) if ctx.get_world_rank() == 0 else SilentHooks(folder)
    train(train_ctx, JobSpec.model_validate(config["spec"]), hooks)


def _steps(folder: Path) -> list[dict[str, Any]]:
    path = folder / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(predicate, timeout: float, what: str) -> Any:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.2)
    raise TimeoutError(what)


#: A baseline phase that takes longer counts as "did not finish" (inf), and the trial ends.
BASELINE_TIMEOUT_S = 300.0
NOT_MEASURED = {"world_after_loss": 0.0, "world_after_add": 0.0}


def baseline_trial(folder: Path) -> dict[str, float]:
    """One Ray Train trial on a fresh cluster (a trainer stuck in an earlier trial must not
    hold the next one's resources)."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = Nodes(cluster)
    for _ in range(WORKERS):
        nodes.add(1)
    ray.init(address=cluster.address)
    result = {k: float("inf") for k in ("submit_to_step_s", "loss_to_step_s", "add_to_step_s",
                                         "recomputed_steps", "drain_to_step_s",
                                         "drain_recomputed_steps")} | NOT_MEASURED  # fmt: skip
    try:
        _baseline_run(nodes, folder, result)
    except TimeoutError as exc:
        print("ray-train: no", exc, f"within {BASELINE_TIMEOUT_S:g} s", flush=True)
    finally:
        (folder / "stop").touch()
        ray.shutdown()
        cluster.shutdown()
    return result


def _baseline_run(nodes: Nodes, folder: Path, result: dict[str, float]) -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    folder.mkdir(parents=True)
    trainer = TorchTrainer(
        train_loop_per_worker=_baseline_loop,
        train_loop_config={
            "folder": str(folder),
            "spec": SPEC,
            "bench_dir": str(Path(__file__).resolve().parent),
        },
        scaling_config=ScalingConfig(
            num_workers=(1, 3), resources_per_worker={"CPU": 1}, elastic_resize_monitor_interval_s=5
        ),
        run_config=RunConfig(
            name=folder.name,
            storage_path=str(folder / "ray"),
            failure_config=FailureConfig(max_failures=-1),
        ),
    )
    thread = threading.Thread(target=trainer.fit, daemon=True)
    t_submit = time.time()
    thread.start()
    _wait(
        lambda: any(s["step"] >= 10 and s["world_size"] == 3 for s in _steps(folder)),
        BASELINE_TIMEOUT_S,
        "step 10",
    )
    started = min(_steps(folder), key=lambda s: s["wall_time"])
    result["submit_to_step_s"] = started["wall_time"] - t_submit
    placement = json.loads(sorted(folder.glob("placement-*.json"))[-1].read_text())
    t_remove = time.time()
    nodes.remove(nodes.node_of(placement[2]))
    after = _wait(
        lambda: [s for s in _steps(folder) if s["wall_time"] > t_remove and s["world_size"] < 3],
        BASELINE_TIMEOUT_S,
        "resume after node loss",
    )
    last_step = max(s["step"] for s in _steps(folder) if s["wall_time"] <= t_remove + 0.5)
    first = min(after, key=lambda s: s["wall_time"])
    result["loss_to_step_s"] = first["wall_time"] - t_remove
    result["recomputed_steps"] = last_step - (first["step"] - 1)
    result["world_after_loss"] = first["world_size"]
    t_add = time.time()
    nodes.add(1)
    grown = _wait(
        lambda: [s for s in _steps(folder) if s["wall_time"] > t_add and s["world_size"] == 3],
        BASELINE_TIMEOUT_S,
        "grow back",
    )
    result["add_to_step_s"] = min(s["wall_time"] for s in grown) - t_add
    result["world_after_add"] = 3
    _baseline_drain(nodes, folder, result)
    (folder / "stop").touch()
    thread.join(timeout=120)


#: Both sides' drains give the node this long before it goes (`--drain-deadline`).
DRAIN_DEADLINE_S = 30.0


def _baseline_drain(nodes: Nodes, folder: Path, result: dict[str, float]) -> None:
    """The drain elastrain gets (rank 2's node, deadline 30 s), asked of Ray itself the way
    the autoscaler, KubeRay or a preemption notice asks (`drain_node`, reason
    preemption). Whatever Ray Train does about it is measured; at the deadline the node
    goes, as a cloud takes a preempted machine."""
    from ray.core.generated import autoscaler_pb2

    placement = json.loads(sorted(folder.glob("placement-*.json"))[-1].read_text())
    node_id = placement[2]
    t_drain = time.time()
    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    gcs.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "bench",
        int((t_drain + DRAIN_DEADLINE_S) * 1000),
    )

    def smaller() -> list[dict[str, Any]]:
        return [s for s in _steps(folder) if s["wall_time"] > t_drain and s["world_size"] < 3]

    try:
        after = _wait(smaller, DRAIN_DEADLINE_S, "off the drained node before its deadline")
    except TimeoutError:
        nodes.remove(nodes.node_of(node_id))  # the deadline: the machine goes
        after = _wait(smaller, BASELINE_TIMEOUT_S, "resume after the drained node went")
    last_step = max(s["step"] for s in _steps(folder) if s["wall_time"] <= t_drain)
    first = min(after, key=lambda s: s["wall_time"])
    result["drain_to_step_s"] = first["wall_time"] - t_drain
    result["drain_recomputed_steps"] = max(0, last_step - (first["step"] - 1))


# -- bare torchrun ----------------------------------------------------------------------------

TORCHRUN_LOOP = Path(__file__).with_name("torchrun_loop.py")


def torchrun_trial(folder: Path) -> dict[str, float]:
    """torchrun's cold start of the same loop: launch -> the first optimizer step."""
    folder.mkdir(parents=True)
    spec = {**SPEC, "training": {**SPEC["training"], "max_steps": 3}}
    torchrun = Path(sys.executable).with_name("torchrun")
    t_launch = time.time()
    subprocess.run(
        [str(torchrun), "--standalone", f"--nproc_per_node={WORKERS}", str(TORCHRUN_LOOP),
         "--folder", str(folder), "--spec", json.dumps(spec)],
        check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
    )  # fmt: skip
    first = min(_steps(folder), key=lambda s: s["step"])
    return {"submit_to_step_s": first["wall_time"] - t_launch}


# -- report -----------------------------------------------------------------------------------


def median(trials: list[dict[str, float]], key: str) -> float:
    return statistics.median(t[key] for t in trials)


def shown(value: float, fmt: str) -> str:
    return f"> {BASELINE_TIMEOUT_S:g}" if value == float("inf") else format(value, fmt)


def timeline_table(timelines: list[dict[str, dict[str, float]]]) -> list[str]:
    """Median seconds of each phase, per cause (columns), over the trials."""
    causes = list(ATTEMPT_CAUSES.values())
    rows = ["| phase | " + " | ".join(causes) + " |", "| --- |" + " ---: |" * len(causes)]
    for phase in [*(p for p in PHASES if p != Phase.NODE_JOINED.value), "total"]:
        cells = []
        for cause in causes:
            values = [t[cause][phase] for t in timelines if cause in t and phase in t[cause]]
            cells.append(f"{statistics.median(values):.2f}" if values else "—")
        rows.append(f"| {phase.replace('_', ' ')} | " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    global DRAIN_DEADLINE_S  # one setting the drain helpers of both sides read
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline-repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("docs/bench-elastic.md"))
    parser.add_argument("--no-curves", action="store_true", help="skip the loss-curve runs")
    parser.add_argument(
        "--ray-train-start-timeout",
        type=float,
        default=None,
        help=f"seconds ({RAY_TRAIN_START_TIMEOUT_ENV}); unset: Ray's default, 60",
    )
    parser.add_argument(
        "--drain-deadline",
        type=float,
        default=DRAIN_DEADLINE_S,
        help="seconds both sides' drains give the node (Ray Train waits out most of it)",
    )
    args = parser.parse_args()
    if args.repeats < 1 or args.baseline_repeats < 1:
        # The report sets every figure beside Ray Train's: it needs a trial of each side.
        parser.error("--repeats and --baseline-repeats must be at least 1")
    DRAIN_DEADLINE_S = args.drain_deadline
    if args.ray_train_start_timeout is not None:
        # Set before any cluster starts: the raylets, and so the Train controller, inherit it.
        os.environ[RAY_TRAIN_START_TIMEOUT_ENV] = f"{args.ray_train_start_timeout:g}"

    ours: list[dict[str, float]] = []
    timelines: list[dict[str, dict[str, float]]] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        multi_node_service(Path(tmp), **SERVICE) as (client, nodes),
    ):
        wait_for_warm_pool(client, WORKERS)
        for i in range(args.repeats):
            trial, timeline = elastrain_trial(client, nodes)
            ours.append(trial)
            timelines.append(timeline)
            print("elastrain", i, trial, timeline, flush=True)
            wait_for_warm_pool(client, WORKERS)  # the node added back is up before the next submit
        curves = [] if args.no_curves else loss_curves(client, nodes)

    theirs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.baseline_repeats):
            theirs.append(baseline_trial(Path(tmp) / f"trial{i}"))
            print("ray-train", i, theirs[-1], flush=True)

    bare: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            bare.append(torchrun_trial(Path(tmp) / f"trial{i}"))
            print("torchrun", i, bare[-1], flush=True)

    summary, trials = report(args, ours, timelines, theirs, bare, curves)
    # Two blocks, so the notes written between them (and around them) stay.
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_block(args.out, "elastic-report", summary, new_document=TITLE)
    write_block(args.out, "elastic-trials", trials)
    print(summary, trials, sep="\n\n")


TITLE = "# Start, node loss and return: elastrain vs plain Ray Train elastic vs torchrun\n"


def command(args: argparse.Namespace) -> str:
    words = ["python bench/elastic_bench.py", f"--repeats {args.repeats}",
             f"--baseline-repeats {args.baseline_repeats}"]  # fmt: skip
    if args.no_curves:
        words.append("--no-curves")
    if args.ray_train_start_timeout is not None:
        words.append(f"--ray-train-start-timeout {args.ray_train_start_timeout:g}")
    return " ".join(words)


def report(
    args: argparse.Namespace,
    ours: list[dict[str, float]],
    timelines: list[dict[str, dict[str, float]]],
    theirs: list[dict[str, float]],
    bare: list[dict[str, float]],
    curves: list[tuple[int, float, float, int]],
) -> tuple[str, str]:
    """The summary (setup, the side-by-side table, the timelines) and every trial."""

    def row(label: str, key: str, fmt: str = ".1f", *, ray_train: bool = True,
            torchrun: bool = False) -> str:  # fmt: skip
        b = shown(median(theirs, key), fmt) if ray_train else "—"
        c = shown(median(bare, key), fmt) if torchrun else "—"
        return f"| {label} | {shown(median(ours, key), fmt)} | {b} | {c} |"

    start_timeout = (
        "60 s (default)"
        if args.ray_train_start_timeout is None
        else f"{args.ray_train_start_timeout:g} s"
    )
    first_submit = ours[0]["submit_to_step_s"]
    later_submits = [t["submit_to_step_s"] for t in ours[1:]] or [first_submit]
    summary = [
        f"`{command(args)}` on a {os.cpu_count()}-core machine: `ray.cluster_utils.Cluster`, "
        f"CPU-less head + {WORKERS} worker nodes of 1 logical CPU; gpt (2 layers, 32 wide, "
        "seq 32), global batch 24, DDP, checkpoint every 5 steps, min 1 / max 3 workers. "
        f"elastrain grow interval {GROW_INTERVAL_S:g} s, 1 warm process per node; Ray Train "
        f"resize monitor interval 5 s, worker-group start timeout {start_timeout}, other "
        "settings default; torchrun `--standalone --nproc_per_node 3`, no Ray. Medians of the "
        "trials, side by side in one run; times end at the wall clock of the first optimizer "
        "step after the event.",
        "",
        "| | elastrain | Ray Train elastic | torchrun |",
        "| --- | ---: | ---: | ---: |",
        row("submit -> first optimizer step (s)", "submit_to_step_s", torchrun=True),
        row("node removed -> first step after resume (s)", "loss_to_step_s"),
        row("node added -> first step at the bigger size (s)", "add_to_step_s"),
        row("node joined -> first step at the bigger size (s)", "join_to_step_s", ray_train=False),
        row("node joined -> grow decision (s)", "join_to_decision_s", ray_train=False),
        row(
            "grow decision -> first step at the bigger size (s)",
            "decision_to_step_s",
            ray_train=False,
        ),
        row("steps recomputed per node loss", "recomputed_steps", ".0f"),
        row(
            f"node drained (deadline {DRAIN_DEADLINE_S:g} s) -> first step at the smaller size (s)",
            "drain_to_step_s",
        ),
        row("steps recomputed per drain", "drain_recomputed_steps", ".0f"),
        row("restarts counted per drain", "drain_restarts", ".0f", ray_train=False),
        f"| drains resumed from the survivors' memory | "
        f"{sum(t['drain_from_peer'] for t in ours):.0f} of {len(ours)} | — | — |",
        f"| node losses resumed from the survivors' memory | "
        f"{sum(t['restored_from_peer'] for t in ours):.0f} of {len(ours)} | — | — |",
        f"| world size after loss / after return | {median(ours, 'world_after_loss'):.0f} / "
        f"{median(ours, 'world_after_add'):.0f} | {median(theirs, 'world_after_loss'):.0f} / "
        f"{median(theirs, 'world_after_add'):.0f} | — |",
        "",
        f"Ray Train trials with a phase that did not finish within {BASELINE_TIMEOUT_S:g} s "
        f"(counted as > {BASELINE_TIMEOUT_S:g} s): "
        f"{sum(1 for t in theirs if float('inf') in t.values())} of {len(theirs)}.",
        "",
        f"elastrain's submit -> first step: {first_submit:.1f} s for the service's first job, "
        f"{statistics.median(later_submits):.1f} s (median) for a job submitted after the "
        "previous one ended.",
        "",
        "## Where the seconds go (elastrain timelines, median seconds per phase)",
        "",
        "Each phase's seconds since the previous one, from the `timeline` event every attempt",
        "records (`elastrain timeline JOB`). A start's clock starts at submission, a recovery's",
        "when the scheduler saw the node gone, a grow's (node back) when the control plane",
        "first saw the node joined (then its first process warm, then the grow decision), a",
        "drain's at the decision to leave.",
        "",
        *timeline_table(timelines),
    ]
    trials = [
        "Every trial (elastrain):",
        "",
        *[f"- {t}" for t in ours],
        "",
        "Every trial (Ray Train):",
        "",
        *[f"- {t}" for t in theirs],
        "",
        "Every trial (torchrun):",
        "",
        *[f"- {t}" for t in bare],
    ]
    if curves:
        trials += [
            "",
            "## Loss curve: a node lost mid-run (the world size column), vs an uninterrupted run",
            "",
            "| step | interrupted | uninterrupted | world size (interrupted) |",
            "| ---: | ---: | ---: | ---: |",
            *[f"| {s} | {x:.5f} | {y:.5f} | {w} |" for s, x, y, w in curves],
        ]
    return "\n".join(summary), "\n".join(trials)


if __name__ == "__main__":
    main()
