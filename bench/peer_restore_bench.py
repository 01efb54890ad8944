"""Peer memory: what keeping every rank's state in peers' host memory costs, and what it
buys when a node is lost.

1. Hand-over throughput: the state a new group takes from a survivor's memory, streamed
   by `elastrain.workers.memory` (DCP's load planner over an in-memory checkpoint, raw bytes in
   32 MB buckets, `elastrain.workers.memory.peer_reader.PeerReader`) vs a plain `torch.distributed`
   broadcast of the same bytes as one flat tensor, and vs the pickled
   `broadcast_object_list` the hand-over used before. Two gloo processes on this host;
   the state: a gpt-shaped set of fp32 tensors (parameters and AdamW's two moments).
2. Refresh overhead per step: for fsdp, tp and pipeline (2 ranks on 2 simulated nodes,
   each the other's buddy), the median optimizer step and the median refresh (the shard
   copied to host memory and sent to the buddy, the wards' received), the interval the
   measured default chooses (`elastrain.workers.memory.rules`) and the overhead at that interval;
   ddp refreshes nothing (every survivor holds a whole replica).
3. Node lost -> first step at the smaller size, per strategy, on a real
   `ray.cluster_utils.Cluster` (CPU-less head; worker nodes a and b of 2 CPUs, c of 1): a
   job of 4 ranks (min 2, max 4) runs on a and b, the node holding ranks 2 and 3 is removed
   mid-run, and the job resumes on what is left (3 ranks for ddp and fsdp, 2 for tp and
   pipeline, whose replicas are 2 ranks); measured from the removal to the wall clock of
   the first optimizer step after the resume, the steps recomputed (the step the old
   group reached minus the step restored) and where the state came from. These jobs
   refresh peer memory every step (`checkpoint.memory_every: 1`).

    .venv/bin/python bench/peer_restore_bench.py [--repeats 5] [--mb 256]
    .venv/bin/python bench/peer_restore_bench.py --quick      # small sizes, one trial

The report goes between its markers in `--out` (docs/bench-peer-restore.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from bench.report_blocks import write_block
from tests.unit.dist_utils import run_distributed

STRATEGIES = {
    "ddp": {"kind": "ddp"},
    "fsdp": {"kind": "fsdp"},
    "tp": {"kind": "tp", "tensor_parallel": 2},
    "pipeline": {"kind": "pipeline", "pipeline_stages": 2, "microbatches": 2},
}


# ---------------------------------------------------------------------------------------
# 1. Hand-over throughput
# ---------------------------------------------------------------------------------------


def gpt_like_state(total_bytes: int) -> dict[str, torch.Tensor]:
    """fp32 tensors shaped like a gpt's parameters and AdamW's moments (square weights,
    4x MLP, vectors), deterministic, about `total_bytes` in all."""
    width = 1024 if total_bytes >= 150 * 2**20 else 256
    per_block = (4 * width * width + 8 * width * width + 6 * width) * 4 * 3  # p, m, v
    blocks = max(1, total_bytes // per_block)
    gen = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for b in range(blocks):
        for name, shape in (("attn", (width, 4 * width)), ("up", (width, 4 * width)),
                            ("down", (4 * width, width)), ("ln", (6 * width,))):  # fmt: skip
            for kind in ("param", "exp_avg", "exp_avg_sq"):
                state[f"{b}.{name}.{kind}"] = torch.randn(shape, generator=gen)
    return state


def handover_body(rank: int, world_size: int, total_bytes: int, repeats: int) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict_saver

    from elastrain.workers.memory.in_memory import MemoryWriter
    from elastrain.workers.memory.peer_reader import PeerReader

    group = dist.new_group(backend="gloo")
    source = gpt_like_state(total_bytes)
    nbytes = sum(t.numel() * t.element_size() for t in source.values())
    flat = torch.empty(nbytes, dtype=torch.uint8)
    times: dict[str, list[float]] = {"broadcast": [], "handover": [], "pickled": []}
    # Rank 0 holds the state (a survivor); rank 1 is a fresh process of the new group.
    writer = MemoryWriter()
    metadata = None
    if rank == 0:
        metadata = state_dict_saver.save(source, storage_writer=writer, no_dist=True)
    box: list[Any] = [metadata]
    dist.broadcast_object_list(box, src=0, group=group)
    # Rank 0 only serves (a plain broadcast's source copies nothing either).
    target = {k: torch.empty_like(v) for k, v in source.items()} if rank == 1 else {}
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.broadcast(flat, src=0, group=group)
        times["broadcast"].append(time.perf_counter() - t0)

        dist.barrier(group=group)
        t0 = time.perf_counter()
        reader = PeerReader(box[0], holder={0: 0}, local={0: writer.blob} if rank == 0 else {},
                            group=group)  # fmt: skip
        dcp.load(target, storage_reader=reader, process_group=group)
        times["handover"].append(time.perf_counter() - t0)

        dist.barrier(group=group)
        t0 = time.perf_counter()
        obj: list[Any] = [source if rank == 0 else None]
        dist.broadcast_object_list(obj, src=0, group=group)
        times["pickled"].append(time.perf_counter() - t0)
    exact = all(torch.equal(target[k], source[k]) for k in target)
    return {"bytes": nbytes, "times": times, "exact": exact} if rank == 1 else None


# ---------------------------------------------------------------------------------------
# 2. Refresh overhead
# ---------------------------------------------------------------------------------------


def bench_spec(strategy: dict[str, Any], params: dict[str, int], steps: int) -> Any:
    from elastrain.contracts.spec import JobSpec

    return JobSpec(
        name="bench",
        workload={"name": "gpt", "params": params},
        strategy=strategy,
        scaling={"min_workers": 1, "max_workers": 4},
        training={"global_batch_size": 16, "micro_batch_size": 4, "max_steps": steps,
                  "learning_rate": 1e-3, "seed": 0},
        checkpoint={"every_steps": 1_000_000, "async_save": False},
    )  # fmt: skip


def refresh_body(rank: int, world_size: int, params: dict[str, int], steps: int, root: str) -> Any:
    from elastrain.workers.api import TrainContext
    from elastrain.workers.memory.rules import choose_interval, overhead
    from elastrain.workers.memory.snapshots import PeerRefresher
    from elastrain.workers.rng import seed_everything
    from elastrain.workers.sampler import ElasticSampler
    from elastrain.workers.strategies import make_strategy
    from elastrain.workers.workloads import load_workload

    out = {}
    for label, strategy_spec in STRATEGIES.items():
        if label == "ddp":
            continue
        spec = bench_spec(strategy_spec, params, steps)
        ctx = TrainContext(rank=rank, world_size=world_size, local_rank=rank,
                           device=torch.device("cpu"), job_id=1, attempt=1,
                           checkpoint_root=Path(root), node=f"node{rank}")  # fmt: skip
        seed_everything(0)
        workload = load_workload(spec.workload)
        strategy = make_strategy(spec.strategy.kind)
        strategy.setup(workload, ctx, spec)
        peers = PeerRefresher.join(ctx, spec)
        layout = strategy.layout
        sampler = ElasticSampler(len(workload.dataset), 16, 0)
        copies: list[Any] = []
        step_times, refresh_times = [], []
        for step in range(steps):
            batches = []
            for ids in sampler.microbatches(step, layout.dp_rank, layout.dp, 4):
                xs = [workload.dataset[i] for i in ids]
                batches.append((torch.stack([x for x, _ in xs]), torch.stack([y for _, y in xs])))
            dist.barrier()
            t0 = time.perf_counter()
            strategy.step(batches, loss_scale=layout.dp / 16, lr=1e-3)
            step_times.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            peers.refresh(copies, strategy, step + 1)
            refresh_times.append(time.perf_counter() - t0)
        # The first refresh plans (collectively) and allocates: not what later ones cost.
        step_s = statistics.median(step_times[1:])
        refresh_s = statistics.median(refresh_times[1:])
        every = choose_interval(refresh_s, step_s)
        out[label] = {
            "step_s": step_s,
            "refresh_s": refresh_s,
            "first_refresh_s": refresh_times[0],
            "every": every,
            "overhead": overhead(refresh_s, step_s, every),
            "every_step_overhead": overhead(refresh_s, step_s, 1),
            "held_mb": sum(c.nbytes for c in copies[-1:]) / 1e6,
        }
        dist.destroy_process_group(peers.group)
    return out if rank == 0 else None


# ---------------------------------------------------------------------------------------
# 3. Node lost -> first step, per strategy, on a 3-node Cluster
# ---------------------------------------------------------------------------------------


def node_loss_trials(
    strategies: list[str], repeats: int, steps: int, *, compiled: tuple[bool, ...] = (False,)
) -> dict[str, list[dict[str, Any]]]:
    """Per strategy (and, with `compiled`, per `training.compile` setting, labelled
    `<strategy> compiled`), `repeats` node losses, interleaved."""
    from bench.elastic_bench import wait_for_warm_pool
    from tests.integration.cluster_service import multi_node_service
    from tests.integration.ray_service import submit, tiny_gpt_spec, wait_for, wait_terminal

    cases = [(s, c) for s in strategies for c in compiled]
    results: dict[str, list[dict[str, Any]]] = {_case_label(s, c): [] for s, c in cases}
    service = multi_node_service(
        Path(tempfile.mkdtemp(prefix="peer-bench-")), worker_nodes=2, cpus_per_node=2,
        grow_interval_s=3600, warm_workers_per_node=2, allowed_hosts=["testserver"],
    )  # fmt: skip
    with service as (client, nodes):
        nodes.add(1)  # c: room for one rank after the loss
        for i in range(repeats):
            for strategy, compile_on in cases:
                label = _case_label(strategy, compile_on)
                spec = tiny_gpt_spec(
                    f"{strategy}-{i}",
                    strategy=STRATEGIES[strategy],
                    scaling={"min_workers": 2, "max_workers": 4, "cpus_per_worker": 1},
                    training={
                        "global_batch_size": 16,
                        "micro_batch_size": 4,
                        "max_steps": steps,
                        "compile": compile_on,
                    },
                    # Every step: a crash then loses none (the default interval trades
                    # that for <= 5 % of step time; part 2 measures what it chooses).
                    checkpoint={"every_steps": 50, "memory_every": 1},
                    failure={"max_restarts": 0},
                )
                wait_for_warm_pool(client, 5)  # warm processes on every CPU (c's takes over there)
                job_id = submit(client, spec)
                wait_for(client, job_id, lambda j: j["state"] == "RUNNING" and j["step"] >= 12,
                         what="step 12", timeout=300)  # fmt: skip
                events = client.get(f"/v1/jobs/{job_id}/events").json()
                ranks = next(e["details"]["ranks"] for e in events if e["kind"] == "placement")
                t_remove = time.time()
                nodes.remove(nodes.node_of(ranks["3"]))
                wait_for(client, job_id, lambda j: j["attempt"] == 2 and j["state"] == "RUNNING",
                         what="resumed", timeout=300)  # fmt: skip
                points = _wait_points(client, job_id, attempt=2)
                first = min(points, key=lambda p: p["step"])
                client.post(f"/v1/jobs/{job_id}/cancel")
                wait_terminal(client, job_id, timeout=120)
                events = client.get(f"/v1/jobs/{job_id}/events").json()
                lost_step = next(e["details"]["step"] for e in events if e["kind"] == "node_lost")
                # No `resumed` event: the group started fresh (a survivor holding shards was
                # left out of it, e.g. still blocked on the dead node past the driver's wait).
                resumed = next(
                    (e["details"] for e in events if e["kind"] == "resumed"),
                    {"source": "fresh", "steps_recomputed": lost_step},
                )
                trial = {
                    "loss_to_step_s": first["wall_time"] - t_remove,
                    "steps_recomputed": resumed.get("steps_recomputed"),
                    "source": resumed["source"],
                    "world_before": len(ranks),
                    "world_after": first["world_size"],
                }
                results[label].append(trial)
                print(label, i, trial, flush=True)
                nodes.add(2)  # back to 3 nodes for the next trial
    return results


def _case_label(strategy: str, compiled: bool) -> str:
    return f"{strategy} compiled" if compiled else strategy


def _wait_points(
    client: Any, job_id: int, attempt: int, timeout: float = 60
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        points = [
            p for p in client.get(f"/v1/jobs/{job_id}/metrics").json() if p["attempt"] == attempt
        ]
        if points:
            return points
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} attempt {attempt}'s first step")


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mb", type=int, default=256, help="hand-over state size (MB)")
    parser.add_argument("--steps", type=int, default=12, help="steps of the refresh part")
    parser.add_argument("--quick", action="store_true", help="small sizes, one trial")
    parser.add_argument("--no-cluster", action="store_true", help="skip part 3")
    parser.add_argument("--out", type=Path, default=Path("docs/bench-peer-restore.md"))
    parser.add_argument(
        "--compile",
        action="store_true",
        help="part 3 only, for ddp and fsdp, eager and with training.compile side by side",
    )
    args = parser.parse_args()
    if args.compile:
        compile_report(args)
        return
    if args.quick:
        args.repeats, args.mb, args.steps = 1, 16, 4
    params = (
        {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 32}
        if args.quick
        else {"n_layer": 4, "n_embd": 128, "n_head": 4, "seq_len": 128}
    )

    handover = run_distributed(
        handover_body, 2, args.mb * 2**20, max(args.repeats, 3), timeout_s=1200
    )[1]
    print("handover", handover, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        refresh = run_distributed(refresh_body, 2, params, args.steps, tmp, timeout_s=1200)[0]
    print("refresh", refresh, flush=True)
    strategies = ["fsdp"] if args.quick else list(STRATEGIES)
    losses = (
        {}
        if args.no_cluster
        else node_loss_trials(strategies, args.repeats, 400 if not args.quick else 200)
    )
    report = render(args, params, handover, refresh, losses)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_block(args.out, "peer-restore", report, new_document=TITLE)
    print(report)


TITLE = "# Peer memory: refresh cost, hand-over throughput, node loss per strategy\n"


def compile_report(args: argparse.Namespace) -> None:
    """Node lost -> first step with `training.compile` on, beside eager, in one run."""
    losses = node_loss_trials(
        ["ddp", "fsdp"], args.repeats, 200 if args.quick else 400, compiled=(False, True)
    )
    lines = [
        f"`python bench/peer_restore_bench.py --compile --repeats {args.repeats}`: part 3's "
        "node loss, eager and with `training.compile: true` (each block compiled) alternately.",
        "The rank that takes over on node c runs in a process that has not compiled the job's",
        "blocks: it compiles at its first step (inductor's on-disk cache warm from the first job).",
        "",
        "| strategy | node lost -> first step (s), median | trials | steps recomputed |",
        "| --- | ---: | ---: | --- |",
    ]
    for label, trials in losses.items():
        times = [t["loss_to_step_s"] for t in trials]
        lines.append(
            f"| {label} | {statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f}) "
            f"| {len(times)} | {_counted(t['steps_recomputed'] for t in trials)} |"
        )
    block = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_block(args.out, "peer-restore-compile", block, new_document=TITLE)
    print(block)


def render(
    args: argparse.Namespace,
    params: dict[str, int],
    handover: dict[str, Any],
    refresh: dict[str, dict[str, float]],
    losses: dict[str, list[dict[str, Any]]],
) -> str:
    mb = handover["bytes"] / 1e6
    med = {k: statistics.median(v) for k, v in handover["times"].items()}
    words = ["python bench/peer_restore_bench.py", f"--repeats {args.repeats}", f"--mb {args.mb}",
             f"--steps {args.steps}"] if not args.quick else ["python bench/peer_restore_bench.py --quick"]  # fmt: skip
    lines = [
        f"`{' '.join(words)}` on a {os.cpu_count()}-core machine (load average "
        f"{os.getloadavg()[0]:.1f} at the end). Medians.",
        "",
        f"### Hand-over of {mb:.0f} MB (gloo, 2 processes, {len(handover['times']['broadcast'])} runs)",
        "",
        "| | seconds | MB/s | vs plain broadcast |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key, label in (("broadcast", "plain `dist.broadcast` of one flat tensor"),
                       ("handover", "peer hand-over (DCP planner, bucketed p2p)"),
                       ("pickled", "pickled `broadcast_object_list` (before)")):  # fmt: skip
        lines.append(
            f"| {label} | {med[key]:.3f} | {mb / med[key]:.0f} | {med['broadcast'] / med[key]:.2f}x |"
        )
    lines.append("")
    lines.append(f"Loaded bit for bit: {handover['exact']}.")
    lines += [
        "",
        f"### Refresh overhead per step (gpt {params}, 2 ranks on 2 nodes, each the other's buddy)",
        "",
        "| strategy | step (ms) | refresh (ms) | first refresh (ms, plans) | default interval | overhead at it | every step | held per rank (MB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| ddp | — | 0 | — | none (whole replicas) | 0 % | 0 % | 0 |",
    ]
    for label, r in refresh.items():
        lines.append(
            f"| {label} | {r['step_s'] * 1e3:.1f} | {r['refresh_s'] * 1e3:.1f} | "
            f"{r['first_refresh_s'] * 1e3:.0f} | {r['every']} | {r['overhead']:.1%} | "
            f"{r['every_step_overhead']:.1%} | {r['held_mb']:.2f} |"
        )
    if losses:
        lines += [
            "",
            "### Node lost -> first step at the smaller size (3-node `Cluster`, 4 ranks on 2 "
            "nodes, `memory_every: 1`)",
            "",
            "| strategy | seconds (median) | range | steps recomputed | source | world size |",
            "| --- | ---: | ---: | ---: | --- | --- |",
        ]
        for label, trials in losses.items():
            secs = [t["loss_to_step_s"] for t in trials]
            redo = _counted(str(t["steps_recomputed"]) for t in trials)
            sources = _counted(t["source"] for t in trials)
            worlds = sorted({f"{t['world_before']} -> {t['world_after']}" for t in trials})
            lines.append(
                f"| {label} | {statistics.median(secs):.2f} | {min(secs):.2f}-{max(secs):.2f} | "
                f"{redo} | {sources} | {', '.join(worlds)} |"
            )
    return "\n".join(lines)


def _counted(values: Any) -> str:
    """'0 (x3), 1 (x2)': each value with how many trials had it."""
    counts: dict[str, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return ", ".join(f"{v} (x{n})" for v, n in sorted(counts.items(), key=lambda kv: -kv[1]))


if __name__ == "__main__":
    main()
