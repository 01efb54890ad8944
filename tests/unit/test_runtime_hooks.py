"""Rank 0's messages to the runtime: batched, in order, never lost at the end; controls
read from what the runtime pushed into the process, with no remote call (what keeps a
step's cost close to torchrun's)."""

from __future__ import annotations

import os
import resource
import socket
import threading
from typing import Any

from elastrain.contracts.capability import token_digest
from elastrain.contracts.group import Assignment
from elastrain.contracts.messages import Control, EventKind, StepMetrics, WorkerEvent
from elastrain.contracts.runtime import AttemptKey
from elastrain.workers.process import (
    _PUSH_INTERVAL_S,
    RuntimeHooks,
    WorkerProcess,
    run_at_normal_priority,
)
from elastrain.workers.runtime.guard import RefusalLog
from tests.unit.test_workers_train import make_spec


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Method:
    """A remote method: records its calls; a call's result is ready when `ready` says."""

    def __init__(self, result: Any = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.result = result

    def remote(self, *args: Any) -> tuple[str, int]:
        self.calls.append(args)
        return ("ref", len(self.calls))


class Runtime:
    def __init__(self) -> None:
        self.push_many = Method()
        self.ready = True
        self.late: set[Any] = set()  # pushes not answered yet though `ready`
        self.controls: list[Control] = []

    def take_control(self) -> Control:
        return self.controls.pop(0) if self.controls else Control.NONE


def hooks_for(runtime: Runtime, clock: Clock) -> RuntimeHooks:
    def wait(refs: list[Any], **_: Any) -> tuple[list[Any], list[Any]]:
        if not runtime.ready:
            return [], list(refs)
        return [r for r in refs if r not in runtime.late], [r for r in refs if r in runtime.late]

    return RuntimeHooks(
        runtime,
        AttemptKey(7, 2),
        runtime.take_control,
        capability="cap-7-2",
        clock=clock,
        wait=wait,
    )


def point(step: int) -> StepMetrics:
    return StepMetrics(step=step, loss=1.0, wall_time=1000.0 + step)


def sent(runtime: Runtime) -> list[Any]:
    return [m for _, _, _, batch in runtime.push_many.calls for m in batch]


def test_metrics_go_in_batches_and_other_messages_at_once_in_order() -> None:
    runtime, clock = Runtime(), Clock()
    hooks = hooks_for(runtime, clock)
    hooks.send(point(1))  # the first goes at once (the job page sees the first step)
    for step in range(2, 20):
        clock.now += 0.01
        hooks.send(point(step))
    assert len(runtime.push_many.calls) == 1
    event = WorkerEvent(event=EventKind.PACKAGE, reason="x")
    hooks.send(event)  # not a step: sent now, after the steps before it
    assert [getattr(m, "step", m) for m in sent(runtime)] == [*range(1, 20), event]
    clock.now += _PUSH_INTERVAL_S
    hooks.send(point(20))
    assert len(runtime.push_many.calls) == 3
    hooks.send(point(21))
    hooks.flush()  # the end: nothing left behind
    assert [getattr(m, "step", None) for m in sent(runtime)][-2:] == [20, 21]
    # Every push carries the attempt's capability: the runtime takes no report without it.
    assert all(k == (7, 2) and c == "cap-7-2" for k, c, _, _ in runtime.push_many.calls)
    # Numbered from 0, for the runtime to apply in this order (its calls may run in any).
    assert [number for _, _, number, _ in runtime.push_many.calls] == [0, 1, 2, 3]


def test_a_control_costs_no_remote_call_and_flushes_metrics_first() -> None:
    runtime, clock = Runtime(), Clock()
    hooks = hooks_for(runtime, clock)
    for _ in range(50):  # fifty fast steps with nothing requested: nothing sent
        assert hooks.poll_control() == Control.NONE
        clock.now += 0.01
    assert runtime.push_many.calls == []
    hooks.send(point(1))
    clock.now += 0.01
    hooks.send(point(2))  # pending
    runtime.controls = [Control.CHECKPOINT, Control.STOP]
    assert [hooks.poll_control() for _ in range(3)] == [
        Control.CHECKPOINT,
        Control.STOP,
        Control.NONE,
    ]
    # The steps before the checkpoint request reached the runtime before its checkpoint.
    assert [m.step for m in sent(runtime)] == [1, 2]


def test_the_process_keeps_pushed_controls_by_attempt_until_its_rank_0_takes_them() -> None:
    process = WorkerProcess.__new__(WorkerProcess)  # no Ray, no torch: only the mailbox
    process._lock, process._controls = threading.Lock(), {}
    process._pool_digest, process._refusals = token_digest("pool"), RefusalLog("p")
    process.control("pool", AttemptKey(7, 2), [Control.CHECKPOINT])  # before its rank 0 started
    process.control("pool", [7, 1], ["stop"])  # keys and values as plain data: one key shape
    assert list(process._controls) == [AttemptKey(7, 2), AttemptKey(7, 1)]
    assert all(type(k) is AttemptKey for k in process._controls)
    assert process._take_control(AttemptKey(7, 1)) == Control.STOP
    assert process._take_control(AttemptKey(7, 2)) == Control.CHECKPOINT
    assert process._take_control(AttemptKey(7, 2)) == Control.NONE


def test_a_rank_trains_at_normal_priority_not_at_rays_worker_niceness() -> None:
    """Ray starts workers at niceness 15; `run` puts its training thread back at 0 (the
    threads it starts inherit it), where the process may lower its niceness."""
    seen: dict[str, int] = {}
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def rank() -> None:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, 15)  # as Ray starts it
        run_at_normal_priority()
        seen["rank"] = os.getpriority(os.PRIO_PROCESS, me)
        child = threading.Thread(
            target=lambda: seen.update(child=os.getpriority(os.PRIO_PROCESS, 0))
        )
        child.start()
        child.join()

    thread = threading.Thread(target=rank)
    thread.start()
    thread.join()
    may_lower = os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20
    expected = 0 if may_lower else 15
    assert seen == {"rank": expected, "child": expected}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # per thread


def test_rank_0_keeps_every_point_the_runtime_is_not_known_to_have() -> None:
    """What the loop keeps with each checkpoint for a resume to hand back: every point
    after the last step the runtime is known to hold."""
    runtime, clock = Runtime(), Clock()
    hooks = hooks_for(runtime, clock)
    assert hooks.undelivered() == []
    hooks.send(point(1))  # the first goes at once, and is delivered
    assert hooks.undelivered() == []
    runtime.ready = False  # cut off: pushes go out and never arrive
    for step in range(2, 6):
        clock.now += 1.0
        hooks.send(point(step))
    assert [p.step for p in hooks.undelivered()] == [2, 3, 4, 5]
    runtime.ready = True  # the network heals: the pending pushes arrive
    clock.now += 1.0
    hooks.send(point(6))
    assert hooks.undelivered() == []


def test_a_push_answered_before_an_earlier_one_proves_nothing_delivered() -> None:
    """The runtime applies pushes in number order: while push 1 is unanswered, push 2's
    answer does not mean its points are applied (they wait for push 1's)."""
    runtime, clock = Runtime(), Clock()
    hooks = hooks_for(runtime, clock)
    hooks.send(point(1))  # push 0, answered
    runtime.late = {("ref", 2)}  # push 1 (step 2) not answered yet
    clock.now += 1.0
    hooks.send(point(2))
    clock.now += 1.0
    hooks.send(point(3))  # push 2, answered
    assert [p.step for p in hooks.undelivered()] == [2, 3]
    runtime.late = set()
    clock.now += 1.0
    hooks.send(point(4))
    assert hooks.undelivered() == []


def test_a_checkpoint_keeps_the_newest_points_and_every_undelivered_one() -> None:
    from elastrain.workers.reports import METRICS_KEPT_WITH_CHECKPOINT, Reports

    runtime, clock = Runtime(), Clock()
    hooks = hooks_for(runtime, clock)
    rank0, rank1 = Reports(hooks, rank=0), Reports(hooks, rank=1)
    newest = METRICS_KEPT_WITH_CHECKPOINT
    for reports in (rank0, rank1):
        reports.step(point(1))  # delivered (rank 0's)
    runtime.ready = False  # cut off: a zombie trains on, twice as long as it keeps points
    last = 2 * newest + 1
    for step in range(2, last + 1):
        clock.now += 1.0
        for reports in (rank0, rank1):
            reports.step(point(step))
    assert [p.step for p in rank0.kept_with_checkpoint()] == list(range(2, last + 1))
    # Only rank 0 speaks (and tracks delivery); every rank keeps the newest points.
    assert [p.step for p in rank1.kept_with_checkpoint()] == list(
        range(last - newest + 1, last + 1)
    )
    runtime.ready = True  # the network heals: everything sent has arrived
    clock.now += 1.0
    rank0.step(point(last + 1))
    assert [p.step for p in rank0.kept_with_checkpoint()] == list(
        range(last - newest + 2, last + 2)
    )
    assert [m.step for m in sent(runtime) if isinstance(m, StepMetrics)] == list(range(1, last + 2))


def test_the_next_groups_store_listens_from_the_moment_its_port_is_handed_out() -> None:
    """`host_store` opens rank 0's TCPStore at once on a port the OS picked (a port only
    found free could be taken before rank 0 binds it); rank 0's assignment on that port
    takes that very store, any other assignment does not, and a newer call replaces it."""
    process = WorkerProcess.__new__(WorkerProcess)  # no Ray: only the store's bookkeeping
    process._lock, process._hosted_store, process.address = threading.Lock(), None, "127.0.0.1"
    process._pool_digest, process._refusals = token_digest("pool"), RefusalLog("p")
    port = process.host_store("pool", 2, 30.0)
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # listening already, before any rank runs

    def assignment(rank: int, master_port: int) -> Assignment:
        return Assignment(
            job_id=1, attempt=1, rank=rank, world_size=2, master_addr="127.0.0.1",
            master_port=master_port, spec=make_spec("ddp"), storage_path="/tmp", database="db",
            runtime_name="r", namespace="n", collective_timeout_s=30.0,
        )  # fmt: skip

    hosted = process._hosted_store
    assert process._take_hosted_store(assignment(1, port)) is None  # not rank 0
    process._hosted_store = hosted
    assert process._take_hosted_store(assignment(0, port + 1)) is None  # another port
    process._hosted_store = hosted
    assert process._take_hosted_store(assignment(0, port)) is hosted
    assert process._take_hosted_store(assignment(0, port)) is None  # taken once

    first = process.host_store("pool", 2, 30.0)
    second = process.host_store("pool", 2, 30.0)
    assert first != second and process._hosted_store.port == second
