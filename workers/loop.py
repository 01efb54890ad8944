"""The training loop every rank runs. Reads top to bottom: set up, resume, step, save.

Runs under any torch.distributed launcher (the worker processes, torchrun, the tests'
spawn helper): the process group must be initialised before `train()` is called. It talks
to the service only through `hooks` (rank 0's, by way of `elastrain.workers.reports`) and returns a
`TrainResult`. Any exception propagates, so the launcher can mark the job failed with the
error. What one optimizer step does is the strategy's `step` (`elastrain.workers.strategies`);
where the state comes from, `elastrain.workers.resume`; what each step reports,
`elastrain.workers.step_metrics`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from elastrain.checkpoints.fence import FenceWatcher, Superseded
from elastrain.contracts.messages import Control, Phase, TimelineMark
from elastrain.contracts.spec import JobSpec, StrategyKind
from elastrain.workers.activation import apply_activation_checkpointing
from elastrain.workers.api import (
    AttemptAborted,
    SampleDataset,
    TrainContext,
    TrainHooks,
    TrainResult,
)
from elastrain.workers.checkpointing import (
    make_checkpointer,
    save_checkpoint,
    settles_staging,
)
from elastrain.workers.compiling import compile_units
from elastrain.workers.errors import configuration_errors
from elastrain.workers.local_work import LocalWork
from elastrain.workers.lr_schedule import lr_at
from elastrain.workers.memory.replica import ReplicaMemory
from elastrain.workers.memory.snapshots import PeerRefresher
from elastrain.workers.profiling import StepProfiler
from elastrain.workers.progress import Progress
from elastrain.workers.rank_output import rank_log
from elastrain.workers.reports import Reports
from elastrain.workers.resume import describe_restore, restore
from elastrain.workers.rng import seed_everything
from elastrain.workers.sampler import ElasticSampler, batch_crc, replica_microbatches
from elastrain.workers.step_metrics import StepMeter
from elastrain.workers.strategies import MicroBatch, Strategy, make_strategy
from elastrain.workers.workloads import WorkloadError, load_workload

log = logging.getLogger("elastrain.workers.loop")

LOG_EVERY_STEPS = 10
#: Controls that end the attempt at this step boundary (STOP after its checkpoint).
_STOPS = (Control.STOP, Control.LEAVE)


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
    with rank_log(ctx.log_path, ctx.rank):
        return _train(ctx, spec, hooks, memory if memory is not None else ReplicaMemory())


def _train(
    ctx: TrainContext, spec: JobSpec, hooks: TrainHooks, memory: ReplicaMemory
) -> TrainResult:
    training = spec.training
    global_batch = training.global_batch_size
    micro_batch = training.micro_batch_size
    max_steps = training.max_steps
    is_rank0 = ctx.rank == 0
    reports = Reports(hooks, rank=ctx.rank)

    # Same seed on every rank before building, so every rank builds the same initial model.
    seed_everything(training.seed)
    workload = load_workload(spec.workload, storage_root=ctx.storage_root)
    strategy = make_strategy(spec.strategy.kind)
    # Before the strategy wraps the model (FSDP shards the checkpointed blocks as they are).
    apply_activation_checkpointing(
        workload.model, training.activation_checkpointing, strategy.activations
    )
    if training.compile:
        if spec.strategy.kind == StrategyKind.pipeline:  # `auto` may have chosen it
            raise WorkloadError("training.compile: not supported with kind 'pipeline' yet")
        compile_units(workload.model)
    strategy.setup(workload, ctx, spec)
    layout = strategy.layout
    with configuration_errors("workload: its dataset"):  # its length, its first sample
        sampler = ElasticSampler(len(workload.dataset), global_batch, training.seed)
        collate = Collator(workload.dataset)
        evaluator = Evaluator.of(workload.eval_dataset, spec, ctx.device)
    checkpointer = make_checkpointer(ctx, spec)
    # Peer memory: each rank's shard kept in host memory with a copy on another node.
    peers = PeerRefresher.join(ctx, spec)
    if is_rank0:
        log.info(
            "job %s attempt %s: %s world_size=%d dp=%d pp=%d tp=%d G=%d micro=%d accum=%d "
            "steps=%d", ctx.job_id, ctx.attempt, spec.strategy.label, ctx.world_size, layout.dp,
            layout.pp, layout.tp, global_batch, micro_batch,
            sampler.num_microbatches(layout.dp, micro_batch), max_steps,
        )  # fmt: skip

    # Resume from a survivor's memory, else the latest good checkpoint (whatever world
    # size or split wrote it), else start fresh.
    restored = restore(checkpointer, strategy, ctx, reports, training.seed, memory, peers.group)
    start_step = done = ctx.step = restored.step if restored is not None else 0
    # The newest metric points come along with the state, and go on with it.
    reports.carry_on(restored.metrics if restored is not None else ())
    # From here on this process's memory is the new state (the old one was handed on).
    memory.hold(
        job_id=ctx.job_id, strategy=strategy, step=start_step, world_size=ctx.world_size,
        attempt=ctx.attempt, recent=reports.recent, rank=ctx.rank,
    )  # fmt: skip
    reports.send(
        TimelineMark(
            phase=Phase.STATE_RESTORED,
            at=time.time(),
            detail=describe_restore(restored),
            source=restored.source if restored is not None else None,
            steps_recomputed=restored.steps_recomputed if restored is not None else None,
        )
    )

    # Every strategy averages gradients over the dp replicas; each replica's summed
    # loss times dp/G makes that average the gradient of the global-batch mean loss.
    loss_scale = layout.dp / global_batch
    meter = StepMeter(strategy, workload, spec, world_size=ctx.world_size, device=ctx.device)
    control = Control.NONE
    stalled = 0.0  # seconds the last checkpoint save blocked training (goodput)
    # A newer attempt of the job exists (this one's node was declared lost but its
    # processes live on): stop before doing or writing anything more (checkpoints/fence.py).
    fence = FenceWatcher(ctx.checkpoint_root.parent, ctx.attempt, owner=ctx.database)
    profiler = StepProfiler.from_env(ctx.checkpoint_root.parent, ctx.attempt, ctx.rank)
    # The runtime's hang watch reads this rank's progress from it (`workers/progress.py`).
    progress = ctx.progress if ctx.progress is not None else Progress()
    progress.started(start_step)
    # ... and its straggler watch the seconds of each step no peer paces (`local_work`).
    local = LocalWork(strategy.optimizer, ctx.device)
    with (
        stops_when_superseded(ctx, fence),
        settles_staging(checkpointer),
        contextlib.closing(local),
    ):
        for step in range(start_step, max_steps):
            if ctx.abort is not None and ctx.abort.is_set():
                raise AttemptAborted(f"attempt {ctx.attempt} released at step {step}")
            fence.check()
            profiler.before(step + 1)
            t0 = time.perf_counter()
            meter.start_step()
            ids = sampler.microbatches(step, layout.dp_rank, layout.dp, micro_batch)
            # The job's very first step is the workload's code's first run on real samples
            # (forward, loss, backward): what it raises there it raises on every retry.
            first_use = (
                configuration_errors("workload: the job's first training step")
                if step == 0
                else contextlib.nullcontext()
            )
            # Asked outside it: the service's side of the line is not the workload's code.
            asked = reports.poll_control()
            # Every rank agrees on the step (the global loss, rank 0's control) before any
            # updates its weights, so all act on a control at the same step.
            with first_use:
                progress.mark("data")
                fetched = time.perf_counter()
                batches = [collate(mb) for mb in ids]
                local.data(time.perf_counter() - fetched)
                progress.mark("step")
                result = strategy.step(
                    batches,
                    loss_scale=loss_scale,
                    lr=lr_at(step, training),  # a function of the step: resumes agree
                    control=asked,
                    wait_staged=checkpointer.wait_staged,
                )
            done = ctx.step = memory.step = step + 1
            progress.stepped(done, local.take())
            step_time = time.perf_counter() - t0
            loss, control = result.loss_sum / global_batch, result.control
            eval_loss = None
            if evaluator is not None and evaluator.due(done):
                progress.mark("eval")
                eval_loss = evaluator.run(strategy)

            # Every rank keeps the point (the loss is global), rank 0 sends it.
            point = meter.point(
                done, loss, step_time, batch_crc(sampler.global_batch(step)),
                checkpoint_stall_s=stalled + result.staging_wait_s, eval_loss=eval_loss,
            )  # fmt: skip
            reports.step(point)
            stalled = 0.0
            if is_rank0 and (done % LOG_EVERY_STEPS == 0 or done == start_step + 1):
                log.info("step %d loss %.4f (%.3fs)", done, loss, step_time)

            saving = (
                done % spec.checkpoint.every_steps == 0
                or done == max_steps
                or control in (Control.CHECKPOINT, Control.STOP)
            )
            # A STOP or LEAVE (resize, drain) hands the state on as it is now: refresh at
            # this step (LEAVE saves no checkpoint: the state goes on in memory alone).
            if done < max_steps:
                progress.mark("memory")  # (a refresh of a large state may take a while)
                peers.after_step(memory.copies, strategy, done, step_time,
                                 final=control in _STOPS)  # fmt: skip
            if saving:
                progress.mark("checkpoint")
                reason = control.value if control != Control.NONE else "scheduled"
                stalled = save_checkpoint(checkpointer, strategy, ctx, spec, done, reason=reason,
                                          metrics=reports.kept_with_checkpoint(),
                                          last=done == max_steps or control in _STOPS)  # fmt: skip
            # Every rank polls: a failed background save then raises on every rank alike.
            reports.commits(checkpointer.poll_commits())
            profiler.after(done)
            if control in _STOPS:
                break

        # Waits for the in-flight async save to commit, then stops the checkpointer's thread.
        reports.commits(checkpointer.close())
    stopped = control in _STOPS and done < max_steps
    if is_rank0:
        log.info("%s at step %d", "stopped" if stopped else "finished", done)
        if peers.pacer.refreshes:
            log.info("peer memory: %s", peers.describe(memory.copies))
    return TrainResult(
        final_step=done,
        stopped_early=stopped,
        resumed_from_step=restored.step if restored is not None else None,
    )


# ---------------------------------------------------------------------------------------
# Pieces of the loop
# ---------------------------------------------------------------------------------------


class Evaluator:
    """The held-out loss: the same first `eval_samples` samples every time (a comparable
    curve), split over the data-parallel replicas like a training batch, summed over the
    world and divided by their number; the same value at any world size up to float
    reduction order."""

    def __init__(self, dataset: SampleDataset, *, every: int, last: int, samples: int,
                 micro: int, device: torch.device) -> None:  # fmt: skip
        self.every = every
        self.last = last
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
        return cls(dataset, every=every, last=spec.training.max_steps,
                   samples=spec.training.eval_samples, micro=spec.training.micro_batch_size,
                   device=device)  # fmt: skip

    def due(self, done: int) -> bool:
        """Whether to evaluate after optimizer step `done`: every `every`, and the last."""
        return done % self.every == 0 or done == self.last

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

    def __call__(self, ids: list[int]) -> MicroBatch:
        if not ids:
            return self.empty
        samples = [self.dataset[i] for i in ids]
        return torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])


@contextlib.contextmanager
def stops_when_superseded(ctx: TrainContext, fence: FenceWatcher) -> Iterator[None]:
    """A newer attempt of the job has started (the fence moved; found by the loop or by the
    checkpoint committer, which then refused to commit): stop as an aborted attempt, not a
    failed one, and say so in the job's log.

    A rank whose collective broke because a peer stopped at the fence first (the peer read
    it a step earlier) reads the fence once more: it too was superseded, not failed."""
    try:
        yield
    except AttemptAborted:
        raise
    except Exception as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, Superseded):
            cause = cause.__cause__
        if cause is None:
            cause = _superseded_now(fence)
        if cause is None:
            raise
        log.warning("%s: stopping at step %d, writing nothing more", cause, ctx.step)
        raise AttemptAborted(str(cause)) from exc


def _superseded_now(fence: FenceWatcher) -> Superseded | None:
    try:
        fence.check()
    except Superseded as exc:
        return exc
    except Exception:  # an unreadable fence says nothing about the error at hand
        return None
    return None
