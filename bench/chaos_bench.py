"""A chaos campaign: faults of every kind we can inject on this machine, drawn from a seeded
schedule, against one long job per strategy, with the recovery time of each.

A `ray.cluster_utils.Cluster` with a CPU-less head and 3 worker nodes of 1 CPU each, the
service on top (as `elastrain serve` would run it, in this process). For each strategy a
tiny `gpt` job (ddp and fsdp: 1 to 3 workers; tp and pipeline: 2) trains while faults are
injected one after another: each once the job runs again and has made a few steps since
the last. Kinds (`--kinds`):

- `kill9`: a rank's process killed with SIGKILL;
- `node_removed`: the node of a rank removed (its raylet and processes stopped);
- `raylet_kill`: the raylet of a rank's node killed with SIGKILL (the node dies under the
  job, its processes with it);
- `freeze`: a rank's process stopped with SIGSTOP (found by the hang watch);
- `slow`: a rank's process made about 2x slower from outside (stopped and resumed in turns
  every few milliseconds: `tests/integration/cluster_service.slowed`), found by the
  straggler watch, evicted (`failure.stragglers: evict`);
- `preemption`: a rank's node drained with a deadline, as a preemption notice does.

A node lost or removed is replaced by a new one at once (capacity comes back; the job grows
back onto it when it can), a drained node undrained once the job left it. Per fault:
recovery = fault -> the first step of the next attempt (wall clock of the step), the steps
recomputed (the timeline's `state_restored`), restarts counted. After its faults the job
is cancelled, and its loss per step (its last attempt's value for a step) is compared with
an uninterrupted run of the same spec to the same step.

    .venv/bin/python bench/chaos_bench.py [--faults 200] [--seed 7] [--strategies ...]

`bench/all.py --quick` runs a few faults on ddp alone, to check that it runs. Not injected
yet: network partitions, control-plane kill -9, PostgreSQL restarts and hangs inside a
collective (see the report).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report_blocks import write_block
from tests.integration.cluster_service import Nodes, multi_node_service, slowed
from tests.integration.ray_service import submit, tiny_gpt_spec, wait_for, wait_terminal

KINDS = ("kill9", "node_removed", "raylet_kill", "freeze", "slow", "preemption")
STRATEGIES = {
    "ddp": ({"kind": "ddp"}, 1, 3),
    "fsdp": ({"kind": "fsdp"}, 1, 3),
    "tp": ({"kind": "tp"}, 2, 2),
    "pipeline": ({"kind": "pipeline", "pipeline_stages": 2}, 2, 2),
}
#: Steps a job makes in its current attempt before the next fault.
STEPS_BETWEEN = 8
#: A fault not recovered from in this long counts as not recovered.
RECOVERY_TIMEOUT_S = 180.0
SERVICE: dict[str, Any] = {
    "grow_interval_s": 2.0,
    "allowed_hosts": ["testserver"],
    "metric_points_per_s": 10_000,  # every step's point kept: the curves compare them all
}


@dataclass
class Fault:
    strategy: str
    kind: str
    rank: int
    at: float
    recovered_s: float | None = None
    recomputed: int | None = None
    restarts: int = 0
    note: str = ""


@dataclass
class Campaign:
    client: Any
    nodes: Nodes
    rng: random.Random
    faults: list[Fault] = field(default_factory=list)
    resumed_at: int = 0
    """The step the job's current attempt started from (the next fault waits for a few
    more)."""


def spec(strategy: str, steps: int) -> dict[str, Any]:
    kind, low, high = STRATEGIES[strategy]
    return tiny_gpt_spec(
        f"chaos-{strategy}",
        strategy=kind,
        scaling={"min_workers": low, "max_workers": high, "cpus_per_worker": 1},
        training={"max_steps": steps},
        checkpoint={"every_steps": 25, "keep_last": 2},
        failure={
            "max_restarts": 1000,
            "stragglers": "evict",
            "straggler_cooldown_s": 20,  # (the threshold and window: the defaults)
        },
    )


def _events(client: Any, job_id: int) -> list[dict[str, Any]]:
    return client.get(f"/v1/jobs/{job_id}/events").json()


def _points(client: Any, job_id: int, since: int = 0) -> list[dict[str, Any]]:
    return client.get(f"/v1/jobs/{job_id}/metrics", params={"since_step": since}).json()


def _all_points(client: Any, job_id: int) -> list[dict[str, Any]]:
    """Every point, page by page (a page holds at most 10,000 rows; a step's rows of
    several attempts may straddle two pages: the last step is read again)."""
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    since = 0
    while True:
        page = _points(client, job_id, since)
        fresh = [p for p in page if (p["step"], p["attempt"]) not in seen]
        seen.update({(p["step"], p["attempt"]): p for p in page})
        if not fresh or len(page) < 10_000:
            return sorted(seen.values(), key=lambda p: (p["step"], p["attempt"]))
        since = page[-1]["step"]


def _placement(client: Any, job_id: int, attempt: int) -> dict[str, Any]:
    return next(
        e["details"]
        for e in reversed(_events(client, job_id))
        if e["kind"] == "placement" and e["attempt"] == attempt
    )


def _raylet_pid(node: Any) -> int:
    import ray._private.ray_constants as constants

    return int(node.all_processes[constants.PROCESS_TYPE_RAYLET][0].process.pid)


def inject(c: Campaign, job: dict[str, Any], kind: str) -> Fault:
    """Inject one fault into the job's running attempt and wait for the next attempt's
    first step."""
    client, job_id, attempt = c.client, job["id"], job["attempt"]
    placement = _placement(client, job_id, attempt)
    rank = c.rng.randrange(len(placement["ranks"]))
    node_id, pid = placement["ranks"][str(rank)], int(placement["pids"][str(rank)])
    fault = Fault(strategy=job["name"].removeprefix("chaos-"), kind=kind, rank=rank, at=0.0)
    before, step = job["restarts"], job["step"]
    fault.at = time.time()
    after: Any = None
    if kind == "kill9":
        os.kill(pid, signal.SIGKILL)
    elif kind == "node_removed":
        c.nodes.remove(c.nodes.node_of(node_id))
        c.nodes.add(1)
    elif kind == "raylet_kill":
        node = c.nodes.node_of(node_id)
        os.kill(_raylet_pid(node), signal.SIGKILL)
        after = lambda: _replace(c.nodes, node)  # noqa: E731
    elif kind == "freeze":
        os.kill(pid, signal.SIGSTOP)
        after = lambda: _quietly(os.kill, pid, signal.SIGCONT)  # noqa: E731
    elif kind == "preemption":
        answer = client.post(
            f"/v1/cluster/nodes/{node_id}/drain",
            json={"deadline_s": 60, "reason": "chaos: preemption notice"},
        )
        assert answer.status_code == 200, answer.text
        after = lambda: client.post(f"/v1/cluster/nodes/{node_id}/undrain")  # noqa: E731
    slow = slowed(pid) if kind == "slow" else contextlib.nullcontext()
    try:
        with slow:
            _recovered(c, job_id, attempt, step, fault)
    finally:
        if after is not None:
            after()
    fault.restarts = client.get(f"/v1/jobs/{job_id}").json()["restarts"] - before
    return fault


def _replace(nodes: Nodes, node: Any) -> None:
    """A node whose raylet was killed, once the job recovered: whatever is left of it
    stopped (the cluster's bookkeeping counts it until then) and a new node in its place."""
    with contextlib.suppress(Exception):
        nodes.remove(node)
    nodes.add(1)


def _quietly(fn: Any, *args: Any) -> None:
    with contextlib.suppress(OSError):
        fn(*args)


def _recovered(c: Campaign, job_id: int, attempt: int, step: int, fault: Fault) -> None:
    """Wait for the first step of an attempt after `attempt` (the job was at `step`)."""
    deadline = fault.at + RECOVERY_TIMEOUT_S
    while time.time() < deadline:
        # (A resume recomputes at most the steps since a checkpoint: 25 here.)
        points = _points(c.client, job_id, since=max(0, step - 100))
        later = [p for p in points if p["attempt"] > attempt]
        if later:
            first = min(later, key=lambda p: (p["attempt"], p["step"]))
            fault.recovered_s = first["wall_time"] - fault.at
            fault.recomputed = _recomputed(c.client, job_id, first["attempt"])
            c.resumed_at = first["step"]
            return
        state = c.client.get(f"/v1/jobs/{job_id}").json()["state"]
        if state in ("SUCCEEDED", "FAILED", "CANCELLED"):
            fault.note = f"job {state} before a next attempt"
            return
        time.sleep(0.2)
    fault.note = f"no next attempt's step within {RECOVERY_TIMEOUT_S:.0f}s"


def _recomputed(client: Any, job_id: int, attempt: int) -> int | None:
    for e in _events(client, job_id):
        if e["kind"] == "timeline" and e["attempt"] == attempt:
            for phase in e["details"]["phases"]:
                if phase["phase"] == "state_restored":
                    return phase["steps_recomputed"]
    return None


def run_strategy(c: Campaign, strategy: str, faults: int, kinds: list[str]) -> dict[str, Any]:
    """One job through `faults` faults, then cancelled; then an uninterrupted job of the same
    spec to the step the first reached (a constant learning rate: the curve does not
    depend on max_steps)."""
    job_id = submit(c.client, spec(strategy, 1_000_000))
    c.resumed_at = 0
    for _ in range(faults):
        job = _ready(c, job_id)
        if job is None:
            break
        fault = inject(c, job, c.rng.choice(kinds))
        c.faults.append(fault)
        print(strategy, fault, flush=True)
    _ready(c, job_id)  # the last recovery trains on a little
    c.client.post(f"/v1/jobs/{job_id}/cancel")
    final = wait_terminal(c.client, job_id, timeout=600)
    steady_id = submit(c.client, {**spec(strategy, final["step"]), "name": f"steady-{strategy}"})
    steady = wait_terminal(c.client, steady_id, timeout=3600)
    return {
        "strategy": strategy,
        "state": final["state"],
        "steady_state": steady["state"],
        "restarts": final["restarts"],
        "attempts": final["attempt"],
        **_curve(c.client, job_id, steady_id),
    }


def _ready(c: Campaign, job_id: int) -> dict[str, Any] | None:
    """The job once it runs again and made STEPS_BETWEEN steps in its attempt (None: it
    ended)."""

    def ready(j: dict[str, Any]) -> bool:
        running = j["state"] == "RUNNING" and j["step"] >= c.resumed_at + STEPS_BETWEEN
        return running or j["state"] in ("SUCCEEDED", "FAILED", "CANCELLED")

    job = wait_for(c.client, job_id, ready, what="running again", timeout=600, poll_s=0.1)
    return job if job["state"] == "RUNNING" else None


def _curve(client: Any, faulted: int, steady: int) -> dict[str, Any]:
    """Each step's loss (its last attempt's) against the uninterrupted run's."""
    last: dict[int, tuple[int, float]] = {}
    for p in _all_points(client, faulted):
        if p["loss"] is not None and p["attempt"] >= last.get(p["step"], (0, 0.0))[0]:
            last[p["step"]] = (p["attempt"], p["loss"])
    base = {p["step"]: p["loss"] for p in _all_points(client, steady) if p["loss"] is not None}
    common = sorted(set(last) & set(base))
    diffs = [abs(last[s][1] - base[s]) / max(abs(base[s]), 1e-12) for s in common]
    equal = sum(1 for s in common if last[s][1] == base[s])
    return {
        "steps_compared": len(common),
        "bitwise_equal": equal,
        "max_rel_diff": max(diffs, default=float("nan")),
        "final_rel_diff": diffs[-1] if diffs else float("nan"),
    }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(args: argparse.Namespace, faults: list[Fault], curves: list[dict[str, Any]]) -> str:
    by_kind: dict[str, list[Fault]] = defaultdict(list)
    for f in faults:
        by_kind[f.kind].append(f)
    lines = [
        f"Latest run: `{command(args)}` (seed {args.seed}), "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}, on this 2-core machine; "
        f"{len(faults)} faults, {sum(f.recovered_s is not None for f in faults)} recovered.",
        "",
        "| fault | count | recovered | recovery p50 | p95 | max | steps recomputed (max) "
        "| restarts counted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        got = by_kind.get(kind, [])
        if not got:
            continue
        seconds = [f.recovered_s for f in got if f.recovered_s is not None]
        recomputed = [f.recomputed for f in got if f.recomputed is not None]
        shown = (
            [f"{statistics.median(seconds):.2f} s", f"{_pct(seconds, 0.95):.2f} s",
             f"{max(seconds):.2f} s"]
            if seconds else ["-", "-", "-"]
        )  # fmt: skip
        lines.append(
            f"| {kind} | {len(got)} | {len(seconds)} | {' | '.join(shown)} "
            f"| {sum(recomputed)} ({max(recomputed, default=0)}) | {sum(f.restarts for f in got)} |"
        )
    lines += [
        "",
        "| strategy | job | uninterrupted | attempts | restarts | steps compared | bitwise equal "
        "| max relative diff | at the last step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in curves:
        lines.append(
            f"| {c['strategy']} | {c['state']} | {c['steady_state']} | {c['attempts']} "
            f"| {c['restarts']} | {c['steps_compared']} | {c['bitwise_equal']} "
            f"| {c['max_rel_diff']:.2e} | {c['final_rel_diff']:.2e} |"
        )
    missed = [f for f in faults if f.recovered_s is None]
    if missed:
        lines += ["", "Not recovered:", ""]
        lines += [f"- {f.strategy} {f.kind} rank {f.rank}: {f.note}" for f in missed]
    return "\n".join(lines)


def command(args: argparse.Namespace) -> str:
    return (
        f"python bench/chaos_bench.py --faults {args.faults} --seed {args.seed} "
        f"--strategies {','.join(args.strategies)} --kinds {','.join(args.kinds)}"
    )


TITLE = "# Chaos campaign: every fault we can inject, recovered\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--faults", type=int, default=200, help="in all, over the strategies")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--strategies", type=lambda s: s.split(","), default=list(STRATEGIES))
    parser.add_argument("--kinds", type=lambda s: s.split(","), default=list(KINDS))
    parser.add_argument("--out", type=Path, default=Path("docs/bench-chaos.md"))
    args = parser.parse_args()
    unknown = set(args.kinds) - set(KINDS) or set(args.strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown: {sorted(unknown)}")
    per_strategy = max(1, args.faults // len(args.strategies))
    curves = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        multi_node_service(Path(tmp), **SERVICE) as (
            client,
            nodes,
        ),
    ):
        campaign = Campaign(client=client, nodes=nodes, rng=random.Random(args.seed))
        for strategy in args.strategies:
            curves.append(run_strategy(campaign, strategy, per_strategy, args.kinds))
            print(curves[-1], flush=True)
    text = report(args, campaign.faults, curves)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_block(args.out, "chaos-report", text, new_document=TITLE)
    print(text)


if __name__ == "__main__":
    main()
