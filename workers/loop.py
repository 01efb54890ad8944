"""The training loop every rank runs. Reads top to bottom: set up, resume, step, save.

Runs under any torch.distributed launcher (Ray Train, torchrun, the tests' spawn helper):
the process group must be initialised before `train()` is called. It talks to the service
only through `hooks` (rank 0) and returns a `TrainResult`. Any exception propagates, so
the launcher can mark the job failed with the error.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import random
import resource
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoints.fence import FenceWatcher, Superseded
from contracts.messages import (
    CheckpointCommitted,
    EventKind,
    Phase,
    RestoreSource,
    Resumed,
    StepMetrics,
    TimelineMark,
    WorkerEvent,
)
from contracts.spec import JobSpec
from workers.activation import apply_activation_checkpointing
from workers.agreement import StepAgreement
from workers.api import (
    AttemptAborted,
    Control,
    SampleDataset,
    TrainContext,
    TrainHooks,
    TrainResult,
)
from workers.flops import device_peak, mfu
from workers.lr_schedule import lr_at
from workers.memory import NOTHING, ReplicaMemory, share_from_peer
from workers.sampler import ElasticSampler, batch_crc, replica_microbatches
from workers.strategies import Strategy, make_strategy
from workers.workloads import WorkloadError, load_workload

log = logging.getLogger("elastrain.workers.loop")

LOG_EVERY_STEPS = 10
#: Metric points saved with each checkpoint: the newest this many steps (more than the
#: scheduler ever lags behind, which is a second or two of steps). Reports still in flight
#: when an attempt is stopped are then not lost to the job's history: the attempt that
#: resumes from the checkpoint hands them back.
METRICS_KEPT_WITH_CHECKPOINT = 256
#: Rank 0 also keeps every point not yet known to have reached the service, up to this
#: many, and saves them with each checkpoint: a node cut off from the service trains on
#: until its attempt is fenced (hundreds of steps at a small model's speed), and the
#: attempt that resumes from its last checkpoint hands them back.
UNDELIVERED_KEPT = 10_000

#: Memory figures (parameter/gradient/optimizer bytes, activation peak, RSS) are measured on
#: the first step of an attempt and then at most this often; the steps between carry the
#: latest measurement. Measuring walks every parameter and optimizer state and hooks every
#: tensor autograd saves: ~1 ms a step on the 2-core bench, 5 % of a small model's step
#: (bench/step_overhead_bench.py), for figures that do not change from step to step.
MEMORY_EVERY_S = 2.0


def train(
    ctx: TrainContext, spec: JobSpec, hooks: TrainHooks, memory: ReplicaMemory | None = None
) -> TrainResult:
    """Train the job described by `spec`.

    `memory` is what this process kept of the job from an earlier attempt (a process that
    outlives attempts passes the same one each time): the state is taken from there when
    a rank of the group holds a replica newer than the last checkpoint. The loop keeps it
    up to date with every optimizer step, also when it ends by an exception.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("train() needs an initialised torch.distributed process group")
    with _log_to_file(ctx.log_path, ctx.rank):
        return _train(ctx, spec, hooks, memory if memory is not None else ReplicaMemory())


def _train(
    ctx: TrainContext, spec: JobSpec, hooks: TrainHooks, memory: ReplicaMemory
) -> TrainResult:
    training = spec.training
    seed = training.seed
    global_batch = training.global_batch_size
    micro_batch = training.micro_batch_size
    max_steps = training.max_steps
    is_rank0 = ctx.rank == 0

    # Same seed on every rank before building, so every rank builds the same initial model.
    seed_everything(seed)
    workload = load_workload(spec.workload, storage_root=ctx.storage_root)
    strategy = make_strategy(spec.strategy.kind)
    # Before the strategy wraps the model (FSDP shards the checkpointed blocks as they are).
    apply_activation_checkpointing(
        workload.model, spec.training.activation_checkpointing, strategy.activations
    )
    strategy.setup(workload, ctx, spec)
    layout = strategy.layout
    sampler = ElasticSampler(len(workload.dataset), global_batch, seed)
    collate = Collator(workload.dataset)
    checkpointer = make_checkpointer(ctx, spec)
    if is_rank0:
        log.info(
            "job %s attempt %s: %s world_size=%d dp=%d pp=%d tp=%d G=%d micro=%d accum=%d "
            "steps=%d", ctx.job_id, ctx.attempt, spec.strategy.label, ctx.world_size, layout.dp,
            layout.pp, layout.tp, global_batch, micro_batch,
            sampler.num_microbatches(layout.dp, micro_batch), max_steps,
        )  # fmt: skip

    # Resume from a survivor's memory, else the latest good checkpoint (whatever world
    # size or split wrote it), else start fresh.
    restored = restore(checkpointer, strategy, ctx, hooks, seed, memory)
    resumed_from = restored.step if restored is not None else None
    start_step = resumed_from or 0
    ctx.step = start_step

    # Every strategy averages gradients over the dp replicas; each replica's summed
    # loss times dp/G makes that average the gradient of the global-batch mean loss.
    loss_scale = layout.dp / global_batch
    done = start_step  # optimizer steps completed
    # The newest points, saved with each checkpoint and kept in memory (continued across
    # resumes).
    recent: deque[StepMetrics] = deque(
        restored.metrics if restored is not None else (), maxlen=METRICS_KEPT_WITH_CHECKPOINT
    )
    undelivered: deque[StepMetrics] = deque(maxlen=UNDELIVERED_KEPT)  # rank 0's
    # From here on this process's memory is the new state (the old one was handed on).
    memory.hold(
        job_id=ctx.job_id, strategy=strategy, step=start_step, world_size=ctx.world_size,
        attempt=ctx.attempt, recent=recent,
    )  # fmt: skip
    if is_rank0:
        hooks.send(TimelineMark(phase=Phase.STATE_RESTORED, at=time.time(),
                                detail=describe_restore(restored)))  # fmt: skip
    evaluator = Evaluator.of(workload.eval_dataset, spec, ctx.device)
    mixed = spec.strategy.mixed_precision
    peak = device_peak(ctx.device, mixed.value if mixed is not None else None)
    control = Control.NONE
    stalled = 0.0  # seconds the last checkpoint save blocked training (goodput)
    # A newer attempt of the job exists (this one's node was declared lost but its
    # processes live on): stop before doing or writing anything more (checkpoints/fence.py).
    fence = FenceWatcher(ctx.checkpoint_root.parent, ctx.attempt)
    memory_meter = MemoryMeter(strategy)
    with stops_when_superseded(ctx), settles_staging(checkpointer):
        for step in range(start_step, max_steps):
            if ctx.abort is not None and ctx.abort.is_set():
                raise AttemptAborted(f"attempt {ctx.attempt} released at step {step}")
            fence.check()
            t0 = time.perf_counter()
            memory_meter.start_step()
            ids = sampler.microbatches(step, layout.dp_rank, layout.dp, micro_batch)
            # Every rank agrees on the step (its loss, rank 0's control) before any updates
            # its weights, so all act on a control at the same step; the strategy carries
            # the agreement in a collective the step makes anyway where one sums over
            # every rank (`workers.agreement`).
            agreement = StepAgreement(hooks.poll_control() if is_rank0 else Control.NONE)
            strategy.forward_backward([collate(mb) for mb in ids], loss_scale, agreement)
            strategy.prepare_update(agreement)
            loss_sum, control = agreement.wait()
            # An async save's staging copy may still be in the making (it overlaps this
            # step's forward and backward): it must be done before the update, or this
            # step would leak into the previous step's checkpoint.
            stalled += checkpointer.wait_staged()
            strategy.set_lr(lr_at(step, training))  # a function of the step: resumes agree
            strategy.apply_update()
            done = ctx.step = memory.step = step + 1
            step_time = time.perf_counter() - t0
            loss = loss_sum / global_batch
            eval_loss = None
            if evaluator is not None and (done % evaluator.every == 0 or done == max_steps):
                eval_loss = evaluator.run(strategy)

            # Every rank keeps the point (the loss is global), rank 0 sends it: whichever rank
            # survives a loss hands the newest points on with the state, so the reports that
            # died with the attempt (sent after the scheduler's last poll) are filled in.
            point = step_metrics(
                done, loss, step_time, strategy, workload.tokens_per_sample, global_batch,
                ctx.world_size, batch_crc(sampler.global_batch(step)), checkpoint_stall_s=stalled,
                flops_per_sample=workload.flops_per_sample, peak=peak,
                first_of_attempt=step == start_step, memory=memory_meter.read(),
            )  # fmt: skip
            if eval_loss is not None:
                point.values["eval_loss"] = eval_loss
            stalled = 0.0
            recent.append(point)
            if is_rank0:
                hooks.send(point)
                undelivered.append(point)
                delivered = hooks.delivered_step()
                while undelivered and undelivered[0].step <= delivered:
                    undelivered.popleft()
                if done == start_step + 1:
                    hooks.send(TimelineMark(phase=Phase.FIRST_STEP, at=point.values["wall_time"]))
                if done % LOG_EVERY_STEPS == 0 or done == start_step + 1:
                    log.info("step %d loss %.4f (%.3fs)", done, loss, step_time)

            if (
                done % spec.checkpoint.every_steps == 0
                or done == max_steps
                or control != Control.NONE
            ):
                reason = control.value if control != Control.NONE else "scheduled"
                stalled = save_checkpoint(checkpointer, strategy, ctx, spec, done, reason=reason,
                                          metrics=kept_with_checkpoint(recent, undelivered))  # fmt: skip
            # Every rank polls: a failed background save then raises on every rank alike.
            commits = checkpointer.poll_commits()
            if is_rank0:
                forward_commits(commits, hooks)
            if control == Control.STOP:
                break

        # Waits for the in-flight async save to commit, then stops the checkpointer's thread.
        commits = checkpointer.close()
        if is_rank0:
            forward_commits(commits, hooks)
    stopped = control == Control.STOP and done < max_steps
    if is_rank0:
        log.info("%s at step %d", "stopped" if stopped else "finished", done)
    return TrainResult(final_step=done, stopped_early=stopped, resumed_from_step=resumed_from)


# ---------------------------------------------------------------------------------------
# Pieces of the loop
# ---------------------------------------------------------------------------------------


class Evaluator:
    """The held-out loss: the same first `eval_samples` samples every time (a comparable
    curve), split over the data-parallel replicas like a training batch, summed over the
    world and divided by their number; the same value at any world size up to float
    reduction order."""

    def __init__(self, dataset: SampleDataset, *, every: int, samples: int, micro: int,
                 device: torch.device) -> None:  # fmt: skip
        self.every = every
        self.ids = list(range(min(samples, len(dataset))))
        self.micro = micro
        self.device = device
        self.collate = Collator(dataset)

    @classmethod
    def of(
        cls, dataset: SampleDataset | None, spec: JobSpec, device: torch.device
    ) -> Evaluator | None:
        every = spec.training.eval_every
        if every is None:
            return None
        if dataset is None or len(dataset) == 0:
            raise WorkloadError(
                "training.eval_every: the workload has no held-out samples (its eval_dataset "
                "is empty or missing)"
            )
        return cls(dataset, every=every, samples=spec.training.eval_samples,
                   micro=spec.training.micro_batch_size, device=device)  # fmt: skip

    def run(self, strategy: Strategy) -> float:
        layout = strategy.layout
        shares = replica_microbatches(self.ids, layout.dp_rank, layout.dp, self.micro)
        local = strategy.evaluate([self.collate(mb) for mb in shares])
        total = torch.tensor([local], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)  # pipeline: only last stages hold a loss, one per replica
        return float(total.item()) / len(self.ids)


class Collator:
    """Sample ids -> stacked (inputs, targets). An empty id list gives size-0 tensors with
    the right trailing shape and dtype (strategies turn those into zero-weight steps)."""

    def __init__(self, dataset: SampleDataset) -> None:
        self.dataset = dataset
        x0, y0 = dataset[0]
        self.empty = (x0.new_empty((0, *x0.shape)), y0.new_empty((0, *y0.shape)))

    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if not ids:
            return self.empty
        samples = [self.dataset[i] for i in ids]
        return torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])


@contextlib.contextmanager
def stops_when_superseded(ctx: TrainContext) -> Iterator[None]:
    """A newer attempt of the job has started (the fence moved; found by the loop or by the
    checkpoint committer, which then refused to commit): stop as an aborted attempt, not a
    failed one, and say so in the job's log."""
    try:
        yield
    except AttemptAborted:
        raise
    except Exception as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, Superseded):
            cause = cause.__cause__
        if cause is None:
            raise
        log.warning("%s: stopping at step %d, writing nothing more", cause, ctx.step)
        raise AttemptAborted(str(cause)) from exc


@contextlib.contextmanager
def settles_staging(checkpointer: Any) -> Iterator[None]:
    """Leaving by an exception, first let an async save's staging copy finish: this
    process's state may live on for the next attempt (ReplicaMemory), which must not
    change it under the copy."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # the failure being raised says more
            checkpointer.wait_staged()
        raise


def make_checkpointer(ctx: TrainContext, spec: JobSpec) -> Any:
    # Imported here so the rest of `workers` imports without the DCP machinery loaded.
    from checkpoints.dcp import ShardedCheckpointer

    return ShardedCheckpointer(
        ctx.checkpoint_root,
        rank=ctx.rank,
        world_size=ctx.world_size,
        async_save=spec.checkpoint.async_save,
        # The loop waits for the staging copy before each optimizer step (`_train`).
        async_staging=spec.checkpoint.async_save,
    )


def restore(
    checkpointer: Any,
    strategy: Strategy,
    ctx: TrainContext,
    hooks: TrainHooks,
    seed: int,
    memory: ReplicaMemory,
) -> Resumed | None:
    """Every rank calls it. From a peer's memory when some rank holds a full replica of the
    job at least as new as the newest checkpoint (no step lost), else `resume`."""
    newest = newest_checkpoint_step(ctx.checkpoint_root) if ctx.rank == 0 else None
    offers: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(offers, (memory.step_for(ctx.job_id), newest))
    held = [step for step, _ in offers]
    newest = offers[0][1]
    best = max(held)
    if best == NOTHING or best == 0 or (newest is not None and newest > best):
        memory.forget()  # superseded (or nothing): do not keep two models alive
        return resume(checkpointer, strategy, ctx, hooks, seed)
    donor = held.index(best)
    meta = share_from_peer(memory, strategy, donor)
    reseed(seed, best, ctx.rank)  # a new group: per-rank streams restart from (seed, step)
    restored = Resumed(
        step=best,
        path="",
        saved_world_size=int(meta["world_size"]),
        world_size=ctx.world_size,
        saved_attempt=int(meta["attempt"]),
        metrics=tuple(StepMetrics.from_point(p) for p in meta["metrics"]),
        source=RestoreSource.PEER,
    )
    if ctx.rank == 0:
        log.info("resumed at step %d from the memory of rank %d", best, donor)
        hooks.send(restored)
    return restored


def newest_checkpoint_step(root: Path) -> int | None:
    from checkpoints import list_committed

    committed = list_committed(root) if root.exists() else []
    return committed[0].step if committed else None


def describe_restore(restored: Resumed | None) -> str:
    if restored is None:
        return "fresh start"
    if restored.source == RestoreSource.PEER:
        return f"peer memory at step {restored.step}"
    return f"checkpoint step {restored.step}"


def resume(
    checkpointer: Any, strategy: Strategy, ctx: TrainContext, hooks: TrainHooks, seed: int
) -> Resumed | None:
    """Load the latest good checkpoint into the strategy; what was restored (on every rank;
    rank 0 also reports it), or None for a fresh start. Every rank must call it (DCP
    loads collectively)."""
    state = strategy.state_dict_for_checkpoint()
    outcome = checkpointer.load_latest(state)
    if outcome is not None and ctx.rank == 0:
        for path, reason in outcome.skipped:
            log.warning("skipped checkpoint %s: %s", path, reason)
            hooks.send(
                WorkerEvent(
                    event=EventKind.CHECKPOINT_FALLBACK, reason=reason, details={"path": str(path)}
                )
            )
    if outcome is None:
        reseed(seed, 0, ctx.rank)
        return None
    strategy.load_checkpoint_state(state)
    step: int = outcome.info.step
    extra = outcome.rank_extra
    if extra is not None and extra.get("world_size") == ctx.world_size:
        set_rng_states(extra)  # same world size: continue this rank's exact RNG streams
    else:
        reseed(seed, step, ctx.rank)  # resharded: per-rank streams have no successor
    restored = Resumed(
        step=step,
        path=str(outcome.info.path),
        saved_world_size=outcome.info.world_size,
        world_size=ctx.world_size,
        saved_attempt=outcome.info.attempt,
        metrics=saved_metrics(outcome.info.manifest.extra),
    )
    if ctx.rank == 0:
        log.info("resumed from %s at step %d", outcome.info.path, step)
        hooks.send(restored)
    return restored


def save_checkpoint(
    checkpointer: Any,
    strategy: Strategy,
    ctx: TrainContext,
    spec: JobSpec,
    done: int,
    *,
    reason: str,
    metrics: Iterable[StepMetrics] = (),
) -> float:
    """Save a checkpoint of step `done`; returns the seconds training was blocked."""
    training = spec.training
    layout = strategy.layout
    blocked = checkpointer.save(
        step=done,
        attempt=ctx.attempt,
        state=strategy.state_dict_for_checkpoint(),
        manifest_fields={
            "strategy": spec.strategy.label,
            "layout": {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp},
            "data_position": {
                "step": done,
                "samples_consumed": done * training.global_batch_size,
            },
            "extra": {
                "seed": training.seed,
                "global_batch_size": training.global_batch_size,
                "micro_batch_size": training.micro_batch_size,
                "metrics": [m.to_point() for m in metrics],
                # With the manifest's commit time: the save's seconds (Prometheus).
                "save_started_at": time.time(),
            },
        },
        rank_extra=get_rng_states(ctx.world_size),
    )
    if ctx.rank == 0:
        log.info("checkpoint at step %d (%s): blocked %.3fs", done, reason, blocked)
    return float(blocked)


def kept_with_checkpoint(
    recent: Iterable[StepMetrics], undelivered: Iterable[StepMetrics]
) -> list[StepMetrics]:
    """The points a checkpoint carries: the newest ones, and every one not known to have
    reached the service; one per step, in step order."""
    return sorted({p.step: p for p in (*undelivered, *recent)}.values(), key=lambda p: p.step)


def saved_metrics(extra: dict[str, Any]) -> tuple[StepMetrics, ...]:
    """The metric points a checkpoint's manifest carries (see `save_checkpoint`)."""
    return tuple(StepMetrics.from_point(p) for p in extra.get("metrics") or ())


def forward_commits(commits: list[CheckpointCommitted], hooks: TrainHooks) -> None:
    for commit in commits:
        log.info("checkpoint committed: %s", commit.path)
        hooks.send(commit)


def step_metrics(
    done: int,
    loss: float,
    step_time: float,
    strategy: Strategy,
    tokens_per_sample: int | None,
    global_batch: int,
    world_size: int,
    crc: int,
    *,
    checkpoint_stall_s: float = 0.0,
    flops_per_sample: float | None = None,
    peak: tuple[float | None, str] = (None, ""),
    first_of_attempt: bool = False,
    memory: dict[str, int] | None = None,
) -> StepMetrics:
    samples_per_s = global_batch / step_time
    layout = strategy.layout
    flops_per_s, utilisation = mfu(flops_per_sample, global_batch, step_time, world_size, peak[0])
    values = {
        "loss": loss,
        "lr": strategy.optimizer.param_groups[0]["lr"],
        "step_time_s": step_time,
        # The checkpoint save that blocked training just before this step (0: none).
        "checkpoint_stall_s": checkpoint_stall_s,
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * tokens_per_sample if tokens_per_sample else None,
        # Model FLOPs per second per rank, and over the device's peak (workers/flops.py).
        "model_flops_per_s": flops_per_s,
        "mfu": utilisation,
        "world_size": world_size,
        "dp": layout.dp,
        "pp": layout.pp,
        "tp": layout.tp,
        "memory": memory if memory is not None else measure_memory(strategy),
        "batch_crc": crc,
        # When the step finished (wall clock): recovery and growth times are measured
        # from it, not from when the scheduler happened to persist the point.
        "wall_time": time.time(),
    }
    if first_of_attempt:  # where the peak comes from, or why there is no MFU: once
        values["mfu_basis"] = (
            peak[1] if flops_per_sample else "the workload gives no flops_per_sample"
        )
    return StepMetrics(step=done, values=values)


class MemoryMeter:
    """Measures a rank's memory on the first step and then every `MEMORY_EVERY_S`, arming
    the activation meter only for the steps it measures (its hooks cost every saved
    tensor a call). Each rank decides alone: the figures are per rank, no peer waits."""

    def __init__(
        self,
        strategy: Strategy,
        every_s: float = MEMORY_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.strategy = strategy
        self.every_s = every_s
        self.clock = clock
        self._measured_at = -math.inf
        self._latest: dict[str, int] | None = None
        self._due = True

    def start_step(self) -> None:
        self._due = self.clock() - self._measured_at >= self.every_s
        self.strategy.activations.armed = self._due

    def read(self) -> dict[str, int]:
        """This step's figures if it was measured, else the latest (the same dict: never
        mutated once made)."""
        if self._due or self._latest is None:
            self._latest = measure_memory(self.strategy)
            self.strategy.activations.reset()  # the activation peak is per measured step
            self._measured_at = self.clock()
        return self._latest


def measure_memory(strategy: Strategy) -> dict[str, int]:
    return {**strategy.memory_bytes(), "rss_bytes": rss_bytes()}


def rss_bytes() -> int:
    """This process's resident memory now (Linux), else its peak (getrusage, KiB)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------------------
# Randomness
# ---------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def reseed(seed: int, step: int, rank: int) -> None:
    """Per-rank RNG streams (dropout) that depend only on (seed, step, rank)."""
    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    seed_everything(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def get_rng_states(world_size: int) -> dict[str, Any]:
    states: dict[str, Any] = {
        "world_size": world_size,
        "torch_cpu": torch.get_rng_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch_cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch_cpu"])
    random.setstate(_as_tuple(states["python"]))
    if "torch_cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["torch_cuda"])


def _as_tuple(value: Any) -> Any:
    # random.setstate wants tuples; a serialiser may have handed back lists.
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


# ---------------------------------------------------------------------------------------
# Logging
# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _log_to_file(path: Path | None, rank: int) -> Iterator[None]:
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    )
    logger = logging.getLogger("elastrain.workers")
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()
