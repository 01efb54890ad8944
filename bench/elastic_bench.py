"""Node loss and node return: elastrain vs plain Ray Train elastic, same loop, same cluster.

A `ray.cluster_utils.Cluster` with a CPU-less head and 3 worker nodes of 1 CPU each. A
`gpt` job (min 1, max 3 workers, checkpoint every 5 steps) trains; once it is past step 10
the node holding rank 2 is removed, and later a node is added back. Measured per trial:

- node removed -> end of the first optimizer step after the resume (at world size 2);
- node added -> end of the first step at world size 3;
- steps recomputed per failure: last step done before the loss minus the step resumed from.

The baseline runs the very same training loop (`workers.loop.train`, same checkpoints) under
`TorchTrainer` with `ScalingConfig(num_workers=(1, 3))` and `FailureConfig(max_failures=-1)`,
Ray Train's own elastic restarts, with the resize monitor interval at 5 s (default 60 s)
and every other setting at its default. Times come from each step's wall clock.

    .venv/bin/python bench/elastic_bench.py [--repeats 5] [--baseline-repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray
from ray.cluster_utils import Cluster

from contracts.spec import JobSpec
from tests.integration.cluster_service import Nodes, multi_node_service
from tests.integration.ray_service import submit, tiny_gpt_spec, wait_for, wait_terminal

GROW_INTERVAL_S = 2.0
SPEC = tiny_gpt_spec(
    "elastic-bench",
    scaling={"min_workers": 1, "max_workers": 3, "cpus_per_worker": 1},
    training={"global_batch_size": 24, "micro_batch_size": 8, "max_steps": 100000},
    checkpoint={"every_steps": 5, "keep_last": 2, "async_save": False},
    failure={"max_restarts": 3},
)


# -- elastrain ------------------------------------------------------------------------------


def _metrics(client: Any, job_id: int) -> list[dict[str, Any]]:
    return client.get(f"/v1/jobs/{job_id}/metrics").json()


def elastrain_trial(client: Any, nodes: Nodes) -> dict[str, float]:
    job_id = submit(client, SPEC)
    wait_for(client, job_id, lambda j: j["state"] == "RUNNING" and j["step"] >= 10, what="step 10")
    placement = next(
        e["details"]["ranks"]
        for e in client.get(f"/v1/jobs/{job_id}/events").json()
        if e["kind"] == "placement"
    )
    t_remove = time.time()
    nodes.remove(nodes.node_of(placement["2"]))
    recovering = wait_for(client, job_id, lambda j: j["state"] == "RECOVERING", what="recovering")
    last_step = recovering["step"]
    wait_for(
        client, job_id, lambda j: j["attempt"] == 2 and j["state"] == "RUNNING", what="resumed"
    )
    time.sleep(1)
    after = [p for p in _metrics(client, job_id) if p["attempt"] == 2]
    first = min(after, key=lambda p: p["step"])
    t_add = time.time()
    nodes.add(1)
    wait_for(
        client,
        job_id,
        lambda j: j["attempt"] == 3 and j["state"] == "RUNNING",
        what="grown",
        timeout=300,
    )
    time.sleep(1)
    grown = min((p for p in _metrics(client, job_id) if p["attempt"] == 3), key=lambda p: p["step"])
    client.post(f"/v1/jobs/{job_id}/cancel")
    wait_terminal(client, job_id, timeout=120)
    return {
        "loss_to_step_s": first["wall_time"] - t_remove,
        "add_to_step_s": grown["wall_time"] - t_add,
        "recomputed_steps": last_step - (first["step"] - 1),
        "world_after_loss": first["world_size"],
        "world_after_add": grown["world_size"],
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
        client, interrupted, lambda j: j["attempt"] == 2 and j["state"] == "RUNNING", what="resumed"
    )
    nodes.add(1)
    assert wait_terminal(client, interrupted, timeout=600)["state"] == "SUCCEEDED"
    steady = submit(client, {**spec, "name": "curve-steady"})
    assert wait_terminal(client, steady, timeout=600)["state"] == "SUCCEEDED"
    a = {p["step"]: p for p in _metrics(client, interrupted)}
    b = {p["step"]: p for p in _metrics(client, steady)}
    return [(s, a[s]["loss"], b[s]["loss"], a[s]["world_size"]) for s in sorted(b)]


# -- plain Ray Train elastic ------------------------------------------------------------------


class _FileHooks:
    """Rank 0 appends each step to a JSONL file; a `stop` file ends the run."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def send(self, message: Any) -> None:
        from contracts.messages import StepMetrics

        if isinstance(message, StepMetrics):
            point = message.to_point()
            with (self.folder / "steps.jsonl").open("a") as f:
                f.write(json.dumps({k: point[k] for k in ("step", "wall_time", "world_size")}))
                f.write("\n")

    def poll_control(self):  # type: ignore[no-untyped-def]
        from workers.api import Control

        return Control.STOP if (self.folder / "stop").exists() else Control.NONE


class _NoHooks(_FileHooks):
    def send(self, message: Any) -> None: ...


def _baseline_loop(config: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from workers.api import TrainContext
    from workers.loop import train

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
    hooks = _FileHooks(folder) if ctx.get_world_rank() == 0 else _NoHooks(folder)
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


def baseline_trial(nodes: Nodes, folder: Path) -> dict[str, float]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    folder.mkdir(parents=True)
    trainer = TorchTrainer(
        train_loop_per_worker=_baseline_loop,
        train_loop_config={"folder": str(folder), "spec": SPEC},
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
    thread.start()
    _wait(
        lambda: any(s["step"] >= 10 and s["world_size"] == 3 for s in _steps(folder)),
        600,
        "step 10",
    )
    placement = json.loads(sorted(folder.glob("placement-*.json"))[-1].read_text())
    last_step = max(s["step"] for s in _steps(folder))
    t_remove = time.time()
    nodes.remove(nodes.node_of(placement[2]))
    after = _wait(
        lambda: [s for s in _steps(folder) if s["wall_time"] > t_remove and s["world_size"] < 3],
        600,
        "resume after node loss",
    )
    last_step = max(s["step"] for s in _steps(folder) if s["wall_time"] <= t_remove + 0.5)
    first = min(after, key=lambda s: s["wall_time"])
    t_add = time.time()
    nodes.add(1)
    grown = _wait(
        lambda: [s for s in _steps(folder) if s["wall_time"] > t_add and s["world_size"] == 3],
        600,
        "grow back",
    )
    (folder / "stop").touch()
    thread.join(timeout=120)
    return {
        "loss_to_step_s": first["wall_time"] - t_remove,
        "add_to_step_s": min(s["wall_time"] for s in grown) - t_add,
        "recomputed_steps": last_step - (first["step"] - 1),
        "world_after_loss": first["world_size"],
        "world_after_add": 3,
    }


# -- report -----------------------------------------------------------------------------------


def summarize(trials: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(t[k] for t in trials) for k in trials[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline-repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("docs/bench-elastic.md"))
    parser.add_argument("--no-curves", action="store_true", help="skip the loss-curve runs")
    args = parser.parse_args()

    ours: list[dict[str, float]] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        multi_node_service(Path(tmp), grow_interval_s=GROW_INTERVAL_S) as (client, nodes),
    ):
        for i in range(args.repeats):
            ours.append(elastrain_trial(client, nodes))
            print("elastrain", i, ours[-1], flush=True)
        curves = [] if args.no_curves else loss_curves(client, nodes)

    theirs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        nodes = Nodes(cluster)
        for _ in range(3):
            nodes.add(1)
        ray.init(address=cluster.address)
        try:
            for i in range(args.baseline_repeats):
                theirs.append(baseline_trial(nodes, Path(tmp) / f"trial{i}"))
                print("ray-train", i, theirs[-1], flush=True)
        finally:
            ray.shutdown()
            cluster.shutdown()

    a, b = summarize(ours), summarize(theirs)
    lines = [
        "# Node loss and return: elastrain vs plain Ray Train elastic",
        "",
        f"`python bench/elastic_bench.py --repeats {args.repeats} --baseline-repeats {args.baseline_repeats}`",
        "on a 2-core machine: `ray.cluster_utils.Cluster`, CPU-less head + 3 worker nodes of 1",
        "logical CPU; gpt (2 layers, 32 wide, seq 32), global batch 24, DDP, checkpoint every 5",
        f"steps, min 1 / max 3 workers. elastrain grow interval {GROW_INTERVAL_S:g} s; Ray Train",
        "resize monitor interval 5 s, other settings default. Medians; times end at the wall clock",
        "of the first optimizer step after the event.",
        "",
        "| | elastrain | Ray Train elastic |",
        "| --- | ---: | ---: |",
        f"| node removed -> first step after resume (s) | {a['loss_to_step_s']:.1f} | {b['loss_to_step_s']:.1f} |",
        f"| node added -> first step at the bigger size (s) | {a['add_to_step_s']:.1f} | {b['add_to_step_s']:.1f} |",
        f"| steps recomputed per failure | {a['recomputed_steps']:.0f} | {b['recomputed_steps']:.0f} |",
        f"| world size after loss / after return | {a['world_after_loss']:.0f} / {a['world_after_add']:.0f} "
        f"| {b['world_after_loss']:.0f} / {b['world_after_add']:.0f} |",
        "",
        "Every trial (elastrain):",
        "",
        *[f"- {t}" for t in ours],
        "",
        "Every trial (Ray Train):",
        "",
        *[f"- {t}" for t in theirs],
        "",
        "## Loss curve: node lost at step ~12, node back later, vs an uninterrupted run",
        "",
        "| step | interrupted | uninterrupted | world size (interrupted) |",
        "| ---: | ---: | ---: | ---: |",
        *[f"| {s} | {x:.5f} | {y:.5f} | {w} |" for s, x, y, w in curves],
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
