"""A chaos campaign: faults of every kind we can inject on this machine, drawn from a seeded
schedule, against one long job per strategy, with the recovery time of each.

A `ray.cluster_utils.Cluster` with a CPU-less head and 3 worker nodes of 1 CPU each, and
the service on top as an operator runs it: `elastrain serve` in a process of its own, on
a PostgreSQL database of its own (created for the run, dropped after), talked to over
HTTP. For each strategy a tiny `gpt` job (ddp and fsdp: 1 to 3 workers; tp and pipeline:
2) trains while faults are injected one after another: each once the job runs again and
has made a few steps since the last. Kinds (`--kinds`):

- `kill9`: a rank's process killed with SIGKILL;
- `node_removed`: the node of a rank removed (its raylet and processes stopped);
- `raylet_kill`: the raylet of a rank's node killed with SIGKILL (the node dies under the
  job, its processes with it);
- `freeze`: a rank's process stopped with SIGSTOP (found by the hang watch);
- `slow`: a rank's process made about 2x slower from outside (stopped and resumed in turns
  every few milliseconds: `tests/integration/cluster_service.slowed`), found by the
  straggler watch, evicted (`failure.stragglers: evict`);
- `preemption`: a rank's node drained with a deadline, as a preemption notice does;
- `control_plane_kill`: the service's process killed with SIGKILL, then started again at
  once on the same database, as an operator's supervisor would;
- `postgres_restart`: the PostgreSQL cluster serving the database restarted
  (`pg_ctl restart -m fast` of the campaign's own server, `tests/pg_server.py`);
- `collective_hang`: a rank hangs inside a collective, its process alive and answering:
  every TCP packet between its process and its peers' processes (their gloo pairs, found
  from /proc) dropped on `lo` by a `tc` filter (found by the hang watch; the filter is
  removed once the job recovered). Needs root and `tc`; not with `--netns` (the ranks'
  traffic there crosses veths, not `lo`).
- `partition` (only with `--netns`): a rank's node cut off the network (its veth on the
  bridge set down), every process on it alive and cut off. Once the job trains again on
  the other nodes, the link is healed, the node's old processes (all but Ray's log
  monitor, which never depended on the raylet) are given PARTITION_EXIT_WAIT_S to go (the
  GCS declared the node dead: its raylet exits when it hears so) and the node is started anew (a new raylet, as a supervisor would), so the
  job can grow back onto it. Per partition the report says the world size at the cut,
  where the next attempt took its state from, how long the cut-off processes took to go after the heal, and whether
  the cut-off attempt committed a checkpoint after the next attempt had started (the
  fence's `committed_by_zombie`: a second group training on).

`--netns` builds the cluster as `tests/chaos/netns_cluster.py`'s `NetnsCluster` instead of
`Cluster` (root only): the head (0 CPUs) on a bridge in the root namespace, each of the 3
worker nodes in a network namespace of its own, on a veth; Ray's health checks there are
1 s x 3 (`HEALTH_CHECK_ENV`; `Cluster` keeps Ray's defaults), so a node lost is declared
dead in about 3-5 s. The node kinds map onto its methods: `node_removed` its
`remove_node` and a new node added, `raylet_kill` its `kill_raylet` and the node started
anew once the job recovered.

A node lost or removed is replaced by a new one at once (capacity comes back; the job grows
back onto it when it can), a drained node undrained once the job left it. Per fault:
recovery = fault -> the first step of the next attempt (wall clock of the step), the steps
recomputed (the timeline's `state_restored`), restarts counted. The control plane's own
faults need not end the attempt (the ranks never touch the service or the database): their
recovery is fault -> the first step trained after the service answers again, whichever
attempt made it, and the report says whether the ranks trained through the outage or were
relaunched. After its faults the job is cancelled, and its loss per step (its last
attempt's value for a step) is compared with an uninterrupted run of the same spec to the
same step; two attempts whose steps overlap in time (two runners of one job) are counted.

    .venv/bin/python bench/chaos_bench.py [--faults 200] [--seed 7] [--strategies ...]
    .venv/bin/python bench/chaos_bench.py --netns --kinds partition,... (root)

`bench/all.py --quick` runs four faults of the node and process kinds on ddp alone, on
`Cluster`, to check that it runs (about 70 s; a control-plane kill in it measured +38 s,
so the new kinds stay out of it, and so does `--netns`). One campaign is on one kind of
cluster: `partition` needs `--netns`, `collective_hang` needs `Cluster`; without
`--kinds`, every kind the cluster can inject.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.report_blocks import write_block
from bench.straggler_bench import epoch
from elastrain.checkpoints.fence import FenceUnreadable, read_fence
from elastrain.checkpoints.layout import iter_step_dirs
from elastrain.checkpoints.manifest import ManifestError, read_manifest
from elastrain.contracts.storage import JobStorage
from tests.chaos.collective_cut import cut_between
from tests.chaos.netns_cluster import HEALTH_CHECK_ENV, NetnsCluster, Node
from tests.e2e.server import ServerHandle, serve_argv, start_server
from tests.integration.cluster_service import Nodes, slowed
from tests.integration.ray_service import tiny_gpt_spec
from tests.pg_server import PrivatePostgres, private_postgres

KINDS = (
    "kill9",
    "node_removed",
    "raylet_kill",
    "freeze",
    "slow",
    "preemption",
    "control_plane_kill",
    "postgres_restart",
    "collective_hang",
    "partition",
)
#: Kinds only one kind of cluster can inject: a partition cuts a node's own link (a
#: namespace's veth), a collective hang filters the ranks' connections on the shared `lo`.
NETNS_ONLY = frozenset({"partition"})
LO_ONLY = frozenset({"collective_hang"})
#: After a partition is healed, how long the cut-off node's old processes are given to
#: exit by themselves before the node is started anew (which kills what is left).
PARTITION_EXIT_WAIT_S = 30.0
#: Ray's own per-node processes that do not depend on the raylet (its log monitor tails the
#: node's log files): on a healed node they live on until the node is started anew, and
#: are not waited for.
RAY_DAEMONS_WITHOUT_RAYLET = frozenset({"log_monitor.py"})
#: Kinds that fault the control plane, not the job's ranks: the attempt may go on.
CONTROL_PLANE = frozenset({"control_plane_kill", "postgres_restart"})
STRATEGIES = {
    "ddp": ({"kind": "ddp"}, 1, 3),
    "fsdp": ({"kind": "fsdp"}, 1, 3),
    "tp": ({"kind": "tp"}, 2, 2),
    "pipeline": ({"kind": "pipeline", "pipeline_stages": 2}, 2, 2),
}
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
#: Steps a job makes in its current attempt before the next fault.
STEPS_BETWEEN = 8
#: A fault not recovered from in this long counts as not recovered.
RECOVERY_TIMEOUT_S = 180.0
#: Kinds a lone rank cannot show: a hang inside a collective needs a peer, and a straggler
#: is slow only against its peers (a job at 1 worker has none to be slower than).
NEEDS_PEERS = frozenset({"collective_hang", "slow"})
#: How long to wait for a job at 1 worker to grow back to 2 before such a fault.
GROW_WAIT_S = 90.0
NAMESPACE = "elastrain-chaos"
#: The `slow` fault's stop/resume period. A slower device is slower on every step; turns
#: make slower only the work that spans a stop. The straggler watch compares the ranks'
#: local work per step (batch and update: 2-5 ms in these jobs here, of which AdamW's
#: update 0.4-0.9 ms). With 4 ms turns a 2.7 ms piece of work ran a median 1.77x slower
#: and a 0.9 ms one was slowed on 38 % of steps; with 0.25 ms turns every piece from 0.2 ms
#: up ran about 2x slower on every step (docs/bench-stragglers.md, "Turns shorter than the
#: work they slow").
SLOW_TURN_S = 0.00025
SERVICE_ENV = {
    "ELASTRAIN_RAY_NAMESPACE": NAMESPACE,
    "ELASTRAIN_SCHEDULER_INTERVAL_S": "0.3",
    "ELASTRAIN_GROW_INTERVAL_S": "2.0",
    # Every step's point kept: the curves compare them all.
    "ELASTRAIN_METRIC_POINTS_PER_S": "10000",
}
SERVICE_START_TIMEOUT_S = 120.0


def default_kinds(netns: bool) -> list[str]:
    """Every kind the chosen cluster can inject, in KINDS' order."""
    return [kind for kind in KINDS if not unavailable_kinds([kind], netns)]


def unavailable_kinds(kinds: list[str], netns: bool) -> list[str]:
    """The kinds asked for that the chosen cluster cannot inject, in the order asked."""
    excluded = LO_ONLY if netns else NETNS_ONLY
    return [kind for kind in kinds if kind in excluded]


@dataclass
class Fault:
    strategy: str
    kind: str
    rank: int
    at: float
    recovered_s: float | None = None
    recomputed: int | None = None
    restarts: int = 0
    detected_s: float | None = None
    """Hangs: fault -> the control plane's decision (the next attempt's `detected` mark)."""
    outage_s: float | None = None
    """Control-plane faults: fault -> the service answering again."""
    trained_through: bool | None = None
    """Control-plane faults: the attempt went on (True) or was relaunched (False)."""
    note: str = ""


@dataclass
class Service:
    """`elastrain serve` in its own process (the handle), restartable on the same
    database, storage and Ray cluster."""

    workdir: Path
    database_url: str
    env: dict[str, str]
    postgres: PrivatePostgres
    """The server of its database (the campaign's own)."""
    handle: ServerHandle
    client: httpx.Client

    @classmethod
    def start(
        cls, workdir: Path, database_url: str, env: dict[str, str], postgres: PrivatePostgres
    ) -> Service:
        handle = _start_server(workdir, database_url, env)
        return cls(workdir, database_url, env, postgres, handle, handle.http(timeout=30))

    def kill(self) -> None:
        """SIGKILL, as a machine or an OOM killer would."""
        self.handle.proc.send_signal(signal.SIGKILL)
        self.handle.proc.wait(30)
        self.client.close()

    def restart(self) -> None:
        """Started again as a supervisor would (a new port: the client follows)."""
        self.handle = _start_server(self.workdir, self.database_url, self.env)
        self.client = self.handle.http(timeout=30)

    def stop(self) -> None:
        self.client.close()
        self.handle.stop()


def _start_server(workdir: Path, database_url: str, env: dict[str, str]) -> ServerHandle:
    return start_server(
        workdir, database_url=database_url, argv=serve_argv, env=env,
        startup_timeout=SERVICE_START_TIMEOUT_S,
    )  # fmt: skip


@dataclass
class NetnsNodes:
    """`NetnsCluster`'s worker nodes behind `Nodes`' interface (add, remove, node_of), plus
    what only it can do."""

    cluster: NetnsCluster

    def add(self, cpus: int = 1) -> Node:
        return self.cluster.add_node(cpus)

    def remove(self, node: Node) -> None:
        self.cluster.remove_node(node)

    def node_of(self, node_id: str) -> Node:
        return self.cluster.node_by_id(node_id)


@dataclass
class Campaign:
    service: Service
    nodes: Nodes | NetnsNodes
    rng: random.Random
    faults: list[Fault] = field(default_factory=list)
    resumed_at: int = 0
    """The step the job's current attempt started from (the next fault waits for a few
    more)."""

    @property
    def client(self) -> httpx.Client:
        return self.service.client


@contextlib.contextmanager
def chaos_service(
    tmp: Path, worker_nodes: int = 3, *, netns: bool = False
) -> Iterator[tuple[Service, Nodes | NetnsNodes]]:
    """The cluster (the head holds no CPUs: training workers land only on the worker nodes,
    and the drivers, 0 CPU, pinned to the head, survive any worker node's loss) and the
    service on it."""
    cluster_cm = netns_cluster(tmp, worker_nodes) if netns else lo_cluster(worker_nodes)
    # A PostgreSQL server of the campaign's own (`postgres_restart` restarts it: the
    # machine's shared one serves other work).
    with cluster_cm as (address, nodes, ray_env), private_postgres() as postgres:
        with psycopg.connect(postgres.url, autocommit=True) as admin:
            admin.execute("CREATE DATABASE elastrain")
        database_url = postgres.url.rpartition("/")[0] + "/elastrain"
        env = {**SERVICE_ENV, **ray_env, "ELASTRAIN_RAY_ADDRESS": address}
        service = Service.start(tmp, database_url, env, postgres)
        try:
            yield service, nodes
        finally:
            service.stop()


@contextlib.contextmanager
def lo_cluster(worker_nodes: int) -> Iterator[tuple[str, Nodes, dict[str, str]]]:
    """`Cluster`: every node's processes in the root namespace, on `lo`."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = Nodes(cluster)
    try:
        for _ in range(worker_nodes):
            nodes.add(1)
        yield cluster.address, nodes, {}
    finally:
        cluster.shutdown()


@contextlib.contextmanager
def netns_cluster(tmp: Path, worker_nodes: int) -> Iterator[tuple[str, NetnsNodes, dict[str, str]]]:
    """`NetnsCluster`: each worker node in a network namespace of its own. This process
    joins as a driver (to learn the nodes' Ray ids, which the placements name)."""
    import ray

    if os.geteuid() != 0:
        raise SystemExit("--netns needs root (CAP_NET_ADMIN)")
    os.environ.update(HEALTH_CHECK_ENV)  # the same settings in every Ray process
    cluster = NetnsCluster(tmp / "netns")
    try:
        cluster.start(node_cpus=[])
        ray.init(
            address=cluster.address, namespace=f"{NAMESPACE}-bench", logging_level=logging.ERROR
        )
        nodes = NetnsNodes(cluster)
        for _ in range(worker_nodes):
            nodes.add(1)
        yield cluster.address, nodes, dict(HEALTH_CHECK_ENV)
    finally:
        ray.shutdown()
        cluster.shutdown()


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


def _get(c: Campaign, path: str, timeout: float = 120.0, **params: Any) -> Any:
    """GET through the service's outages (a restart, its database restarting: refused
    connections, 503s), retried until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            answer = c.client.get(path, params=params)
            if answer.status_code < 500:
                answer.raise_for_status()
                return answer.json()
            error = f"{answer.status_code} {answer.text[:200]}"
        except (httpx.TransportError, RuntimeError) as exc:  # (a closed client: RuntimeError)
            error = repr(exc)
        if time.monotonic() > deadline:
            raise TimeoutError(f"GET {path}: {error}")
        time.sleep(0.2)


def _job(c: Campaign, job_id: int) -> dict[str, Any]:
    job: dict[str, Any] = _get(c, f"/v1/jobs/{job_id}")
    return job


def _events(c: Campaign, job_id: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = _get(c, f"/v1/jobs/{job_id}/events")
    return events


def _points(c: Campaign, job_id: int, since: int = 0) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = _get(c, f"/v1/jobs/{job_id}/metrics", since_step=since)
    return points


def _all_points(c: Campaign, job_id: int) -> list[dict[str, Any]]:
    """Every point, page by page (a page holds at most 10,000 rows; a step's rows of
    several attempts may straddle two pages: the last step is read again)."""
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    since = 0
    while True:
        page = _points(c, job_id, since)
        fresh = [p for p in page if (p["step"], p["attempt"]) not in seen]
        seen.update({(p["step"], p["attempt"]): p for p in page})
        if not fresh or len(page) < 10_000:
            return sorted(seen.values(), key=lambda p: (p["step"], p["attempt"]))
        since = page[-1]["step"]


def _submit(c: Campaign, body: dict[str, Any]) -> int:
    answer = c.client.post("/v1/jobs", json=body)
    assert answer.status_code == 201, answer.text
    return int(answer.json()["id"])


def _placement(c: Campaign, job_id: int, attempt: int) -> dict[str, Any]:
    return next(
        e["details"]
        for e in reversed(_events(c, job_id))
        if e["kind"] == "placement" and e["attempt"] == attempt
    )


def _raylet_pid(node: Any) -> int:
    import ray._private.ray_constants as constants

    return int(node.all_processes[constants.PROCESS_TYPE_RAYLET][0].process.pid)


def inject(c: Campaign, job: dict[str, Any], kind: str) -> Fault:
    """Inject one fault into the job's running attempt and wait for its recovery: the next
    attempt's first step (the control plane's faults: the first step after it is back)."""
    job_id, attempt = job["id"], job["attempt"]
    placement = _placement(c, job_id, attempt)
    rank = c.rng.randrange(len(placement["ranks"]))
    node_id, pid = placement["ranks"][str(rank)], int(placement["pids"][str(rank)])
    peers = [int(p) for r, p in placement["pids"].items() if r != str(rank)]
    fault = Fault(strategy=job["name"].removeprefix("chaos-"), kind=kind, rank=rank, at=0.0)
    before, step = job["restarts"], job["step"]
    fault.at = time.time()
    after: Callable[[], Any] | None = None
    during: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if kind == "kill9":
        os.kill(pid, signal.SIGKILL)
    elif kind == "node_removed":
        c.nodes.remove(c.nodes.node_of(node_id))
        c.nodes.add(1)
    elif kind == "raylet_kill" and isinstance(c.nodes, NetnsNodes):
        netns, netns_node = c.nodes.cluster, c.nodes.node_of(node_id)
        netns.kill_raylet(netns_node)
        after = lambda: netns.start_raylet(netns_node)  # noqa: E731
    elif kind == "raylet_kill":
        lo_nodes = c.nodes
        assert isinstance(lo_nodes, Nodes)
        node = lo_nodes.node_of(node_id)
        os.kill(_raylet_pid(node), signal.SIGKILL)
        after = lambda: _replace(lo_nodes, node)  # noqa: E731
    elif kind == "partition":
        assert isinstance(c.nodes, NetnsNodes), "partition needs --netns"
        cut_node = c.nodes.node_of(node_id)  # (not `cut`: the hang's `with` below binds it)
        c.nodes.cluster.partition(cut_node)
        fault.note = f"cut at world size {job['world_size']}; "
        after = lambda: _heal(c, cut_node, job_id, attempt, fault)  # noqa: E731
    elif kind == "freeze":
        os.kill(pid, signal.SIGSTOP)
        after = lambda: _quietly(os.kill, pid, signal.SIGCONT)  # noqa: E731
    elif kind == "slow":
        during = slowed(pid, period_s=SLOW_TURN_S)
    elif kind == "collective_hang":
        during = cut_between(pid, peers)
    elif kind == "preemption":
        answer = c.client.post(
            f"/v1/cluster/nodes/{node_id}/drain",
            json={"deadline_s": 60, "reason": "chaos: preemption notice"},
        )
        assert answer.status_code == 200, answer.text
        after = lambda: c.client.post(f"/v1/cluster/nodes/{node_id}/undrain")  # noqa: E731
    elif kind == "control_plane_kill":
        c.service.kill()
        c.service.restart()
    elif kind == "postgres_restart":
        fault.note = f"the restart took {restart_postgres(c.service.postgres):.1f}s; "
    try:
        with during as cut:
            if kind in CONTROL_PLANE:
                _trained_after_outage(c, job_id, attempt, step, fault)
            else:
                _recovered(
                    c, job_id, attempt, step, fault, slowed_pid=pid if kind == "slow" else None
                )
            if kind == "collective_hang":
                cut_note = f"{len(cut)} connections cut" if cut else "no connection to a peer found"
                fault.note = f"{cut_note}; {fault.note}"
        if kind == "slow" and cut.factor is not None:  # what the injector achieved
            fault.note = f"slowed {cut.factor:.2f}x at world size {job['world_size']}; {fault.note}"
    finally:
        if after is not None:
            after()
    fault.restarts = _job(c, job_id)["restarts"] - before
    return fault


def restart_postgres(postgres: PrivatePostgres) -> float:
    """A fast restart (open connections cut, no wait for clients), as a failover or an
    operator's restart does; back when the command returns. Its seconds."""
    started = time.monotonic()
    postgres.restart()
    return time.monotonic() - started


def _replace(nodes: Nodes, node: Any) -> None:
    """A node whose raylet was killed, once the job recovered: whatever is left of it
    stopped (the cluster's bookkeeping counts it until then) and a new node in its place."""
    with contextlib.suppress(Exception):
        nodes.remove(node)
    nodes.add(1)


def _heal(c: Campaign, node: Node, job_id: int, attempt: int, fault: Fault) -> None:
    """A partition, once the job recovered (or gave up): the link back up, the node's old
    processes given PARTITION_EXIT_WAIT_S to go by themselves, then the node started anew
    (a new raylet; it kills what is left). What the cut-off attempt did is noted."""
    assert isinstance(c.nodes, NetnsNodes)
    cut_off = lingering(_names(node.pids()))
    c.nodes.cluster.heal(node)
    healed = time.monotonic()
    while (left := lingering(_names(node.pids()))) and (
        time.monotonic() - healed < PARTITION_EXIT_WAIT_S
    ):
        time.sleep(0.2)
    names = _names(left)
    gone = (
        f"{len(left)} of its {len(cut_off)} cut-off processes (the raylet, its agents, the "
        f"job's) still alive {PARTITION_EXIT_WAIT_S:.0f}s after the heal (killed): "
        + ", ".join(names[pid] for pid in left)
        if left
        else f"its {len(cut_off)} cut-off processes (the raylet, its agents, the job's) gone "
        f"{time.monotonic() - healed:.1f}s after the heal"
    )
    zombie = zombie_commits(JobStorage.of(c.service.handle.storage_path, job_id).root, attempt)
    commits = (
        "the fence unreadable: the cut-off attempt's commits unknown"
        if zombie is None
        else f"{len(zombie)} checkpoints committed by the cut-off attempt after it was replaced"
    )
    fault.note += f"; {gone}; {commits}"
    c.nodes.cluster.start_raylet(node)


def _names(pids: list[int]) -> dict[int, str]:
    """Each process's name (`process_name`); a process gone meanwhile is left out."""
    names = {}
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        names[pid] = process_name(cmdline.decode(errors="replace").split("\0"))
    return names


def process_name(argv: list[str]) -> str:
    """What a process of a Ray node is, from its command line: a Ray process's own title
    (`ray::WorkerProcess.run`), a program's file name (`raylet`), a Python script's file
    name (`log_monitor.py`, not `python`)."""
    words = [w.strip() for w in argv if w.strip()]  # (a set title is padded with blanks)
    if not words:
        return "?"
    program = Path(words[0]).name
    if program.startswith("python"):
        script = next((w for w in words[1:] if not w.startswith("-")), program)
        return Path(script).name
    return program if words[0].startswith("/") else words[0]


def lingering(names: dict[int, str]) -> list[int]:
    """Of a cut-off node's processes, those that should go by themselves once it is healed
    (its raylet learns it was declared dead and exits, and the processes it started with
    it): all but Ray's daemons that never depended on the raylet."""
    return sorted(pid for pid, name in names.items() if name not in RAY_DAEMONS_WITHOUT_RAYLET)


def zombie_commits(job_root: Path, attempt: int) -> list[Path] | None:
    """The checkpoints `attempt` committed after a newer attempt had started (the fence's
    own rule): a superseded group that went on training and saving. None: the fence
    cannot be read, so it cannot be told."""
    try:
        fence = read_fence(job_root)
    except FenceUnreadable:
        return None
    found = []
    for step_dir in iter_step_dirs(job_root / "checkpoints"):
        if step_dir.attempt != attempt:
            continue
        try:
            manifest = read_manifest(step_dir.path)
        except ManifestError:
            continue  # not committed
        if fence.committed_by_zombie(attempt, manifest.created_at):
            found.append(step_dir.path)
    return found


def _resumed_from(c: Campaign, job_id: int, attempt: int) -> str:
    """Where `attempt` took the job's state from (its `resumed` event), or `start`."""
    for e in _events(c, job_id):
        if e["kind"] == "resumed" and e["attempt"] == attempt:
            return f"{e['details'].get('source')} at step {e['details'].get('step')}"
    return "no resume (started over)"


def _attempts_without(c: Campaign, job_id: int, pid: int, *, after: int) -> set[int]:
    """The job's attempts after `after` whose placement holds no rank in process `pid`."""
    return {
        e["attempt"]
        for e in _events(c, job_id)
        if e["kind"] == "placement"
        and e["attempt"] > after
        and str(pid) not in {str(p) for p in (e["details"].get("pids") or {}).values()}
    }


def _named_straggler(c: Campaign, job_id: int, fault: Fault) -> bool:
    """Whether the straggler watch named a rank after `fault` was injected."""
    return any(e["kind"] == "straggler" and epoch(e["at"]) >= fault.at for e in _events(c, job_id))


def _quietly(fn: Any, *args: Any) -> None:
    with contextlib.suppress(OSError):
        fn(*args)


def _recovered(
    c: Campaign, job_id: int, attempt: int, step: int, fault: Fault, slowed_pid: int | None = None
) -> None:
    """Wait for the first step of an attempt after `attempt` (the job was at `step`).
    A slowed rank (`slowed_pid`): of the first attempt without that process, and it counts
    as recovered only when the straggler watch named the rank (a grow or another fault's
    relaunch can move the job off the process too: that is no eviction)."""
    deadline = fault.at + RECOVERY_TIMEOUT_S
    while time.time() < deadline:
        # (A resume recomputes at most the steps since a checkpoint: 25 here.)
        points = _points(c, job_id, since=max(0, step - 100))
        later = [p for p in points if p["attempt"] > attempt]
        if later and slowed_pid is not None:
            left = _attempts_without(c, job_id, slowed_pid, after=attempt)
            later = [p for p in later if p["attempt"] in left]
        if later:
            first = min(later, key=lambda p: (p["attempt"], p["step"]))
            if slowed_pid is not None and not _named_straggler(c, job_id, fault):
                fault.note += (
                    f"the job left the slowed process {first['wall_time'] - fault.at:.1f}s "
                    f"after the fault without a straggler event (found as: "
                    f"{_cause(c, job_id, attempt, first['attempt'])}): not an eviction"
                )
                return
            fault.recovered_s = first["wall_time"] - fault.at
            fault.recomputed = _recomputed(c, job_id, first["attempt"])
            fault.detected_s = _detected_at(c, job_id, first["attempt"], fault.at)
            fault.note += f"found as: {_cause(c, job_id, attempt, first['attempt'])}"
            if fault.kind == "partition":
                world = _job(c, job_id)["world_size"]
                fault.note += (
                    f"; resumed from {_resumed_from(c, job_id, first['attempt'])} "
                    f"at world size {world}"
                )
            c.resumed_at = first["step"]
            return
        state = _job(c, job_id)["state"]
        if state in TERMINAL:
            fault.note = f"job {state} before a next attempt"
            return
        time.sleep(0.2)
    fault.note = f"no next attempt's step within {RECOVERY_TIMEOUT_S:.0f}s"


def _trained_after_outage(c: Campaign, job_id: int, attempt: int, step: int, fault: Fault) -> None:
    """A control-plane fault: wait for the service to answer again, then for the first
    step trained after that, by the same attempt (trained through) or a later one
    (relaunched). `step`: the job's step when the fault was injected.

    The points are read from `step` on, not from the job's step at the time of the read:
    the new process stores nothing until its scheduler holds the lease (the killed one's
    runs out up to the lease's TTL after its last renewal), then stores every point of the
    outage and after in one pass, and the job's step jumps with it. A read from 100 steps
    before that step then left out every step of the outage and the first ones after it
    when the ranks had made more than 100 steps since the service answered: the campaign
    reported "no step during the outage" and a first step seconds after the service
    answered, for ranks that had trained at full speed throughout (issue 44)."""
    _get(c, "/healthz", timeout=RECOVERY_TIMEOUT_S)
    back = time.time()
    fault.outage_s = back - fault.at
    deadline = fault.at + RECOVERY_TIMEOUT_S
    stored_again: float | None = None  # when a point made after the fault was first stored
    while time.time() < deadline:
        job = _job(c, job_id)
        # (A relaunch resumes at most the steps since a checkpoint back: 25 here.)
        seen = outage_reading(_points(c, job_id, since=max(0, step - 100)), attempt, fault.at, back)
        if stored_again is None and seen.stored:
            stored_again = time.time()
        if seen.first_after is not None and stored_again is not None:
            first = seen.first_after
            fault.recovered_s = first["wall_time"] - fault.at
            fault.trained_through = first["attempt"] == attempt
            fault.recomputed = (
                0 if fault.trained_through else _recomputed(c, job_id, first["attempt"])
            )
            fault.note += (
                f"trained through: {seen.during} steps during the {fault.outage_s:.1f}s outage"
                if fault.trained_through
                else f"relaunched as attempt {first['attempt']}"
            )
            fault.note += f"; reports stored again {stored_again - back:.1f}s after it answered"
            c.resumed_at = first["step"] if not fault.trained_through else job["step"]
            return
        if job["state"] in TERMINAL:
            fault.note += f"job {job['state']} after the control plane came back"
            return
        time.sleep(0.2)
    fault.note += f"no step after the service was back within {RECOVERY_TIMEOUT_S:.0f}s"


@dataclass(frozen=True)
class OutageReading:
    """What the points stored so far say of a control-plane outage."""

    first_after: dict[str, Any] | None
    """The first point trained after the service answered again (wall clock), by the
    faulted attempt or a later one; None: none stored yet."""
    during: int
    """Steps the faulted attempt made between the fault and the service answering."""
    stored: bool
    """Whether any point made after the fault is stored: the new process schedules."""


def outage_reading(
    points: list[dict[str, Any]], attempt: int, fault_at: float, back: float
) -> OutageReading:
    """Of the points read after a control-plane fault (at `fault_at`; the service answered
    again at `back`), by each point's own wall clock (when its rank made it), not by when
    it was stored: the ranks train on through the outage, the service stores their
    points later."""
    after = [p for p in points if p["attempt"] >= attempt and p["wall_time"] >= back]
    during = {
        p["step"] for p in points if p["attempt"] == attempt and fault_at < p["wall_time"] < back
    }
    return OutageReading(
        first_after=min(after, key=lambda p: p["wall_time"], default=None),
        during=len(during),
        stored=any(p["wall_time"] > fault_at for p in points),
    )


def _recomputed(c: Campaign, job_id: int, attempt: int) -> int | None:
    for phase in _timeline(c, job_id, attempt):
        if phase["phase"] == "state_restored":
            recomputed: int | None = phase["steps_recomputed"]  # (None: unknown)
            return recomputed
    return None


def _detected_at(c: Campaign, job_id: int, attempt: int, since: float) -> float | None:
    """Fault -> the control plane's decision that started `attempt` (its `detected`)."""
    for phase in _timeline(c, job_id, attempt):
        if phase["phase"] == "detected" and phase.get("at") is not None:
            return float(phase["at"]) - since
    return None


def _cause(c: Campaign, job_id: int, faulted: int, next_attempt: int) -> str:
    """How the control plane saw the fault: the faulted attempt's worker errors (type and
    the start of the message, in the order stored), else the next attempt's timeline's
    cause."""
    events = _events(c, job_id)
    errors = [
        f"{e['details'].get('type')}: {str(e['details'].get('message'))[:70]}"
        for e in events
        if e["kind"] == "worker_error" and e["attempt"] == faulted
    ]
    if errors:
        return " | ".join(errors)
    for e in events:
        if e["kind"] == "timeline" and e["attempt"] == next_attempt:
            return str(e["details"].get("cause") or e["reason"])[:160]
    return "?"


def _timeline(c: Campaign, job_id: int, attempt: int) -> list[dict[str, Any]]:
    for e in _events(c, job_id):
        if e["kind"] == "timeline" and e["attempt"] == attempt:
            phases: list[dict[str, Any]] = e["details"]["phases"]
            return phases
    return []


def run_strategy(c: Campaign, strategy: str, faults: int, kinds: list[str]) -> dict[str, Any]:
    """One job through `faults` faults, then cancelled; then an uninterrupted job of the same
    spec to the step the first reached (a constant learning rate: the curve does not
    depend on max_steps)."""
    job_id = _submit(c, spec(strategy, 1_000_000))
    c.resumed_at = 0
    for _ in range(faults):
        kind = c.rng.choice(kinds)
        ranks = 2 if kind in NEEDS_PEERS else 1
        job = _ready(c, job_id, ranks=ranks)
        if job is None:
            break
        if job["world_size"] < ranks:
            note = "the job stayed at 1 worker: not injected"
            c.faults.append(Fault(strategy, kind, -1, time.time(), note=note))
            continue
        fault = inject(c, job, kind)
        c.faults.append(fault)
        print(strategy, fault, flush=True)
    _ready(c, job_id)  # the last recovery trains on a little
    c.client.post(f"/v1/jobs/{job_id}/cancel")
    final = _wait(c, job_id, lambda j: j["state"] in TERMINAL, 600)
    steady_id = _submit(c, {**spec(strategy, final["step"]), "name": f"steady-{strategy}"})
    steady = _wait(c, steady_id, lambda j: j["state"] in TERMINAL, 3600)
    points = _all_points(c, job_id)
    return {
        "strategy": strategy,
        "state": final["state"],
        "steady_state": steady["state"],
        "restarts": final["restarts"],
        "attempts": final["attempt"],
        "overlapping": overlapping_attempts(points),
        **_curve(points, _all_points(c, steady_id)),
    }


def _wait(
    c: Campaign, job_id: int, done: Callable[[dict[str, Any]], bool], timeout: float
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = _job(c, job_id)
        if done(job) or job["state"] in TERMINAL or time.monotonic() > deadline:
            return job
        time.sleep(0.1)


def _ready(c: Campaign, job_id: int, ranks: int = 1) -> dict[str, Any] | None:
    """The job once it runs again and made STEPS_BETWEEN steps in its attempt (None: it
    ended); with `ranks` > 1, also at that many workers if it grows there within
    GROW_WAIT_S."""

    def stepped(j: dict[str, Any]) -> bool:
        return j["state"] == "RUNNING" and j["step"] >= c.resumed_at + STEPS_BETWEEN

    job = _wait(c, job_id, stepped, 600)
    if ranks > 1 and job["state"] == "RUNNING" and job["world_size"] < ranks:
        job = _wait(c, job_id, lambda j: stepped(j) and j["world_size"] >= ranks, GROW_WAIT_S)
    if job["state"] != "RUNNING":
        return None
    return job


def overlapping_attempts(points: list[dict[str, Any]]) -> int:
    """Pairs of consecutive attempts whose steps overlap in time: the later started
    training before the earlier's last step (two runners of one job at once)."""
    spans: dict[int, tuple[float, float]] = {}
    for p in points:
        low, high = spans.get(p["attempt"], (p["wall_time"], p["wall_time"]))
        spans[p["attempt"]] = (min(low, p["wall_time"]), max(high, p["wall_time"]))
    ordered = [spans[a] for a in sorted(spans)]
    return sum(1 for early, late in itertools.pairwise(ordered) if late[0] < early[1])


def _curve(faulted: list[dict[str, Any]], steady: list[dict[str, Any]]) -> dict[str, Any]:
    """Each step's loss (its last attempt's) against the uninterrupted run's."""
    last: dict[int, tuple[int, float]] = {}
    for p in faulted:
        if p["loss"] is not None and p["attempt"] >= last.get(p["step"], (0, 0.0))[0]:
            last[p["step"]] = (p["attempt"], p["loss"])
    base = {p["step"]: p["loss"] for p in steady if p["loss"] is not None}
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


def _seconds(values: list[float]) -> list[str]:
    """p50, p95 and max, or dashes."""
    if not values:
        return ["-", "-", "-"]
    return [
        f"{statistics.median(values):.2f} s",
        f"{_pct(values, 0.95):.2f} s",
        f"{max(values):.2f} s",
    ]


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
        # (A resume from a checkpoint does not say how many steps it recomputes.)
        unknown = sum(f.recomputed is None and f.recovered_s is not None for f in got)
        lines.append(
            f"| {kind} | {len(got)} | {len(seconds)} | {' | '.join(_seconds(seconds))} "
            f"| {sum(recomputed)} ({max(recomputed, default=0)})"
            + (f", {unknown} unknown" if unknown else "")
            + f" | {sum(f.restarts for f in got)} |"
        )
    lines += _control_plane_lines(by_kind) + _hang_lines(by_kind) + _slow_lines(by_kind)
    lines += [
        "",
        "| strategy | job | uninterrupted | attempts | restarts | attempts overlapping "
        "| steps compared | bitwise equal | max relative diff | at the last step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in curves:
        lines.append(
            f"| {c['strategy']} | {c['state']} | {c['steady_state']} | {c['attempts']} "
            f"| {c['restarts']} | {c['overlapping']} | {c['steps_compared']} "
            f"| {c['bitwise_equal']} | {c['max_rel_diff']:.2e} | {c['final_rel_diff']:.2e} |"
        )
    duplicated = [c["strategy"] for c in curves if c["overlapping"]]
    if duplicated:
        shown = ", ".join(duplicated)
        lines += ["", f"**Two runners of one job at once** (attempts overlapping): {shown}."]
    missed = [f for f in faults if f.recovered_s is None]
    if missed:
        lines += ["", "Not recovered:", ""]
        lines += [f"- {f.strategy} {f.kind} rank {f.rank}: {f.note}" for f in missed]
    return "\n".join(lines)


def _control_plane_lines(by_kind: dict[str, list[Fault]]) -> list[str]:
    """The service's outage, and whether the ranks trained through it."""
    rows = [
        f"| {kind} | {' | '.join(_seconds([f.outage_s for f in got if f.outage_s is not None]))} "
        f"| {sum(f.trained_through is True for f in got)} | {sum(f.trained_through is False for f in got)} |"
        for kind in KINDS
        if kind in CONTROL_PLANE and (got := by_kind.get(kind))
    ]
    if not rows:
        return []
    return [
        "",
        "Control-plane faults: fault -> the service answering again (outage), and the job's "
        "attempt after it:",
        "",
        "| fault | outage p50 | p95 | max | trained through | relaunched |",
        "|---|---|---|---|---|---|",
        *rows,
    ]


def _slow_lines(by_kind: dict[str, list[Fault]]) -> list[str]:
    """How much slower the slowed ranks ran (the injector's own count of the time it held
    them stopped), evicted or not: a rank slowed less than the threshold is no straggler."""
    got = by_kind.get("slow", [])
    if not got:
        return []

    def factors(faults: list[Fault]) -> str:
        seen = sorted(float(m.group(1)) for f in faults if (m := _SLOWED.search(f.note)))
        return ", ".join(f"{x:.2f}x" for x in seen) or "-"

    evicted = [f for f in got if f.recovered_s is not None]
    missed = [f for f in got if f.recovered_s is None]
    return [
        "",
        f"Slowed ranks, the slowdown the injector achieved: evicted {factors(evicted)}; "
        f"not evicted {factors(missed)}.",
    ]


_SLOWED = re.compile(r"slowed ([0-9.]+)x")


def _hang_lines(by_kind: dict[str, list[Fault]]) -> list[str]:
    """Hangs: fault -> the control plane's decision to restart (the hang watch's threshold
    plus its report)."""
    rows = [
        f"| {kind} | {' | '.join(_seconds([f.detected_s for f in got if f.detected_s is not None]))} "
        f"| {sum('Hang: ' in f.note for f in got)} "
        f"| {sum('gloo' in f.note and 'Hang: ' not in f.note for f in got)} |"
        for kind in ("freeze", "collective_hang")
        if (got := by_kind.get(kind))
    ]
    if not rows:
        return []
    return [
        "",
        "Hangs: fault -> detected (the next attempt's `detected` mark: the control plane "
        "decided the attempt failed), and what the attempt's first error was:",
        "",
        "| fault | detected p50 | p95 | max | named hung by the hang watch | ended by gloo errors |",
        "|---|---|---|---|---|---|",
        *rows,
    ]


def command(args: argparse.Namespace) -> str:
    return (
        f"python bench/chaos_bench.py --faults {args.faults} --seed {args.seed} "
        f"--strategies {','.join(args.strategies)} --kinds {','.join(args.kinds)}"
        + (" --netns" if args.netns else "")
    )


TITLE = "# Chaos campaign: every fault we can inject, recovered\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--faults", type=int, default=200, help="in all, over the strategies")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--strategies", type=lambda s: s.split(","), default=list(STRATEGIES))
    parser.add_argument(
        "--kinds", type=lambda s: s.split(","), default=None,
        help="default: every kind the cluster can inject (partition only with --netns)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("docs/bench-chaos.md"))
    parser.add_argument(
        "--netns", action="store_true",
        help="worker nodes in network namespaces (NetnsCluster; root): enables partition",
    )  # fmt: skip
    args = parser.parse_args()
    args.kinds = args.kinds or default_kinds(args.netns)
    unknown = set(args.kinds) - set(KINDS) or set(args.strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown: {sorted(unknown)}")
    if unavailable := unavailable_kinds(args.kinds, args.netns):
        where = "with --netns" if args.netns else "without --netns"
        parser.error(f"not injectable {where}: {unavailable}")
    per_strategy = max(1, args.faults // len(args.strategies))
    curves = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        chaos_service(Path(tmp), netns=args.netns) as (service, nodes),
    ):
        campaign = Campaign(service=service, nodes=nodes, rng=random.Random(args.seed))
        for strategy in args.strategies:
            curves.append(run_strategy(campaign, strategy, per_strategy, args.kinds))
            print(curves[-1], flush=True)
    text = report(args, campaign.faults, curves)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_block(args.out, "chaos-report", text, new_document=TITLE)
    print(text)


if __name__ == "__main__":
    main()
