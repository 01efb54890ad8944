"""Where an attempt's ranks run: the placement group it asks Ray for, and the pooled process
it takes on each bundle's node.

A placement group reserves the attempt's resources on the nodes of the processes chosen
for it (`elastrain.workers.runtime.pool`), preferring the nodes of processes that hold the
job's newest state; rank numbers go node by node (`elastrain.workers.runtime.layout`). When
to ask, ask again or give up is the phases' (`elastrain.workers.runtime.phases`); these
functions never wait.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elastrain.contracts.runtime import JobRef, LaunchRequest
from elastrain.contracts.spec import JobSpec
from elastrain.workers.runtime.layout import Slot, rank_order
from elastrain.workers.runtime.phases import Where
from elastrain.workers.runtime.pool import PooledWorker, WorkerPool, choose_worker


def group_prefix(namespace: str) -> str:
    """Placement groups of this namespace's attempts are named with it (then the attempt's
    name): the runtime removes those no live attempt owns, and no other service's."""
    return f"{namespace}:"


def avoiding(nodes: Sequence[str]) -> dict[str, str]:
    """A bundle label selector that keeps a bundle off these (draining) nodes: Ray's
    `!in(...)` on the node id label every node carries; {} when there are none. No space
    after the commas: Ray 2.60 matches the values as written, so `!in(a, b)` would not
    keep a bundle off b."""
    return {"ray.io/node-id": f"!in({','.join(sorted(nodes))})"} if nodes else {}


def preferred_nodes(pool: WorkerPool, request: LaunchRequest) -> list[str]:
    """The nodes of idle processes holding the job's state, newest first, one per rank at
    most (none on a node the attempt must avoid)."""
    avoid = set(request.avoid_nodes)
    holders = sorted(
        (
            w
            for w in pool.job_workers(request.job)
            if w.idle and w.held is not None and w.node_id not in avoid
        ),
        key=lambda w: -w.held.step,  # type: ignore[union-attr]
    )
    return [w.node_id for w in holders][: request.world_size]


def ask(request: LaunchRequest, name: str, where: Where, preferred: Sequence[str]) -> Any:
    """Ask Ray for the attempt's placement group (it answers when placed: `pg.ready()`):
    on the `preferred` nodes first, or anywhere but the nodes to avoid."""
    scaling = request.spec.scaling
    bundle: dict[str, float] = {"CPU": float(scaling.cpus_per_worker)}
    if scaling.use_gpu:
        bundle["GPU"] = float(scaling.gpus_per_worker)
    n = request.world_size
    anywhere = avoiding(request.avoid_nodes)
    selectors: list[dict[str, str]] | None = [anywhere] * n if anywhere else None
    if where == Where.PREFERRED:
        selectors = [{"ray.io/node-id": node} for node in preferred[:n]]
        selectors += [anywhere] * (n - len(selectors))
    return placement_group([bundle] * n, strategy="PACK", name=name,
                           bundle_label_selector=selectors)  # fmt: skip


def being_placed(pg: Any) -> bool:
    """Whether Ray is preparing or committing the group's bundles on their nodes right now.
    Such a group is not removed to ask again: when a node dies under the preparation, Ray
    2.60 leaks the bundles already prepared elsewhere and places no later group on the
    cluster (ray#64693; a chaos run asking again every 0.15-2 s after a raylet kill lost
    its job so, and every later job waited for placement). Waiting for it costs nothing:
    it ends placed, or failed and pending again."""
    stats = ray.util.placement_group_table(pg).get("stats") or {}
    return stats.get("scheduling_state") == "SCHEDULING_STARTED"


def bundle_nodes(pg: Any, n: int) -> list[str]:
    """The node of each of a placed group's `n` bundles."""
    table = ray.util.placement_group_table(pg)
    return [table["bundles_to_node_id"][i] for i in range(n)]


def gpu_processes_back(pool: WorkerPool, nodes: Sequence[str]) -> bool:
    """Whether every node of the bundles has a GPU process for each of its bundles: Ray
    frees a GPU when the attempt using it is released, a moment before that attempt's
    process lets go."""
    with pool.lock:
        return all(pool.gpu_slots(node) >= k for node, k in Counter(nodes).items())


def take_processes(
    pool: WorkerPool,
    request: LaunchRequest,
    pg: Any,
    nodes: Sequence[str],
    holders: list[PooledWorker],
) -> list[PooledWorker]:
    """A process on each bundle's node, taken for the attempt and numbered node by node.
    A rank that needs its own pip environment gets a new private process inside its
    bundle; on a GPU node it borrows a pooled GPU process's GPU (that process is appended
    to `holders`, and stays lent to the attempt meanwhile)."""
    job, key = request.job, request.key
    gpu = request.spec.scaling.use_gpu
    options = private_worker_options(request.spec)
    own_code = request.spec.workload.runs_own_code
    chosen: list[PooledWorker] = []
    with pool.lock:
        try:
            for index, node in enumerate(nodes):
                taken = chosen + holders
                if options is None:
                    worker = warm_worker(pool, node, taken, job, gpu=gpu)
                else:
                    holder = warm_worker(pool, node, taken, job, gpu=True) if gpu else None
                    if holder is not None:  # its GPU is lent to the private process
                        pool.take(holder, key, job)
                        holders.append(holder)
                        holder.handle.free_gpu.remote(pool.token)
                    worker = pool.start(
                        node,
                        private=True,
                        gpu=holder.gpu if holder is not None else None,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, index),
                        **options,
                    )
                pool.take(worker, key, job, own_code=own_code)
                chosen.append(worker)
        except BaseException:
            for w in chosen:  # never handed a rank: back to the pool as they were
                pool.give_back(w, w.held, alive=True)
            raise
    strategy = request.spec.strategy
    order = rank_order(
        [Slot(w.node_id, held_step(w, job)) for w in chosen],
        group_sizes=(strategy.model_parallel_size, strategy.tensor_parallel_degree),
    )
    return [chosen[i] for i in order]


def warm_worker(
    pool: WorkerPool, node: str, taken: Sequence[PooledWorker], job: JobRef, *, gpu: bool
) -> PooledWorker:
    """A pooled process on `node` for one rank (call with the pool's lock held): an idle
    one of the right kind (`choose_worker`), else a new or starting one. A GPU rank's
    bundle holds one of the node's GPUs in Ray, so a process owning a GPU is idle there
    unless one is stuck in an attempt that is over."""
    candidates = [w for w in pool.workers.values() if w.node_id == node and w not in taken]
    chosen = choose_worker(candidates, job, gpu=gpu)
    if chosen is not None:
        return chosen
    return pool.spare_gpu_worker(node, taken) if gpu else pool.spare_cpu_worker(node, taken)


def private_worker_options(spec: JobSpec) -> dict[str, Any] | None:
    """Ray options for a rank that cannot run in a warm pooled process, or None.

    Ray gives a process its pip packages only when it starts in their environment: such a
    rank is a new process inside its bundle, private to its attempt and gone with the
    placement group. (Ray caches the pip environment per node and requirement list, so
    only the first start pays the install.) A GPU rank of such a job borrows the GPU of a
    pooled process, which stays lent to the attempt meanwhile (`take_processes`).
    GPU jobs otherwise run in the pool's warm GPU processes (`elastrain.workers.runtime.pool`).
    """
    if spec.workload.requirements:
        return {"runtime_env": {"pip": list(spec.workload.requirements)}}
    return None


def held_step(w: PooledWorker, job: JobRef) -> int | None:
    held = w.held
    return held.step if held is not None and held.job == job else None


def local_gpus(workers: Sequence[PooledWorker], rank: int, *, use_gpu: bool) -> tuple[int, ...]:
    """The GPUs of the ranks on `rank`'s node, by local rank (a GPU job's)."""
    node = workers[rank].node_id
    gpus = [w.gpu for w in workers if w.node_id == node]
    if not use_gpu or any(g is None for g in gpus):
        return ()
    return tuple(g for g in gpus if g is not None)


def describe(workers: Sequence[PooledWorker], job: JobRef) -> str:
    """The PLACED mark's detail: how many of the processes were warm, how many hold the
    job's state."""
    warm = sum(1 for w in workers if w.info is not None)
    holders = sum(1 for w in workers if w.held is not None and w.held.job == job)
    return f"{len(workers)} processes: {warm} warm, {holders} holding the job's state"
