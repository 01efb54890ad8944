"""Rank 0's messages to the runtime: batched, in order, never lost at the end; the
control asked for at a bounded rate (what keeps a step's cost close to torchrun's)."""

from __future__ import annotations

from typing import Any

from contracts.messages import Control, EventKind, StepMetrics, WorkerEvent
from workers.process import _CONTROL_INTERVAL_S, _PUSH_INTERVAL_S, RuntimeHooks


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
        self.get_control = Method()
        self.control = Control.NONE
        self.ready = True


def hooks_for(runtime: Runtime, clock: Clock) -> RuntimeHooks:
    def wait(refs: list[Any], **_: Any) -> tuple[list[Any], list[Any]]:
        return (list(refs), []) if runtime.ready else ([], list(refs))

    return RuntimeHooks(runtime, (7, 2), clock=clock, wait=wait, get=lambda _: runtime.control)


def point(step: int) -> StepMetrics:
    return StepMetrics(step=step, values={"loss": 1.0})


def sent(runtime: Runtime) -> list[Any]:
    return [m for _, batch in runtime.push_many.calls for m in batch]


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
    assert all(key == (7, 2) for key, _ in runtime.push_many.calls)


def test_control_is_asked_at_most_every_interval_and_flushes_metrics_first() -> None:
    runtime, clock = Runtime(), Clock()
    hooks = hooks_for(runtime, clock)
    for _ in range(50):  # fifty fast steps: one question in flight at a time
        assert hooks.poll_control() == Control.NONE
        clock.now += _CONTROL_INTERVAL_S / 10
    assert 4 <= len(runtime.get_control.calls) <= 6
    hooks.send(point(1))
    clock.now += 0.01
    hooks.send(point(2))  # pending
    runtime.control = Control.CHECKPOINT
    clock.now += _CONTROL_INTERVAL_S
    got = [hooks.poll_control() for _ in range(3)]
    assert Control.CHECKPOINT in got
    # The steps before the checkpoint request reached the runtime before its checkpoint.
    assert [m.step for m in sent(runtime)] == [1, 2]
