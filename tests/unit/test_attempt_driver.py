"""An attempt's driver (`elastrain.workers.runtime.driver`) carried through its phases without
Ray: pooled processes whose replies the test hands back one by one, a placement group the
test places. Each reply's arrival wakes the loop (the driver's `wake`), and the driver moves
on as soon as it is advanced: no sleep anywhere."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import pytest
import ray

from elastrain.contracts.group import HeldState, RunOutcome, WorkerInfo
from elastrain.contracts.messages import (
    DriverStatus,
    ErrorKind,
    Phase,
    Placement,
    WorkerError,
    WorkerFailed,
)
from elastrain.contracts.runtime import JobRef, LaunchRequest
from elastrain.contracts.spec import JobSpec
from elastrain.workers.runtime import collect
from elastrain.workers.runtime import driver as driver_module
from elastrain.workers.runtime.driver import AttemptDriver
from elastrain.workers.runtime.phases import Step, Where
from elastrain.workers.runtime.pool import PooledWorker, WorkerPool
from tests.factories import spec_dict

JOB = JobRef("db", 7)


class _Ref:
    """An object ref whose reply the test gives (`answer`, `die`)."""

    def __init__(self) -> None:
        self._future: Future[Any] = Future()

    def future(self) -> Future[Any]:
        return self._future

    def answer(self, value: Any) -> None:
        self._future.set_result(value)

    def die(self) -> None:
        self._future.set_exception(ray.exceptions.RayActorError())


class _Handle:
    """A process's actor handle: every `handle.method.remote(...)` is recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.refs: dict[str, _Ref] = {}

    def __getattr__(self, method: str) -> Any:
        handle = self

        class _Method:
            def remote(self, *args: Any) -> _Ref:
                handle.calls.append((method, args))
                ref = handle.refs[method] = _Ref()
                return ref

        return _Method()

    def called(self, method: str) -> bool:
        return any(name == method for name, _ in self.calls)


class _PlacementGroup:
    def __init__(self, where: Where) -> None:
        self.where = where
        self.placing = False  # Ray preparing its bundles now (`placement.being_placed`)
        self.ref = _Ref()
        self.id = type("Id", (), {"hex": lambda self: "pg"})()

    def ready(self) -> _Ref:
        return self.ref


class _Cluster:
    """The placement groups asked for and removed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, nodes: list[str]) -> None:
        self.asked: list[_PlacementGroup] = []
        self.removed: list[_PlacementGroup] = []
        monkeypatch.setattr(driver_module, "ask", self._ask)
        monkeypatch.setattr(driver_module, "bundle_nodes", lambda pg, n: nodes[:n])
        monkeypatch.setattr(driver_module, "remove_placement_group", self.removed.append)
        monkeypatch.setattr(driver_module, "being_placed", lambda pg: pg.placing)

    def _ask(self, request: Any, name: str, where: Where, preferred: Any) -> _PlacementGroup:
        self.asked.append(_PlacementGroup(where))
        return self.asked[-1]


def _worker(name: str, node: str, *, held_step: int | None = None) -> PooledWorker:
    held = None
    if held_step is not None:
        held = HeldState(job_id=JOB.job_id, step=held_step, world_size=2, full_replica=True,
                         database=JOB.database)  # fmt: skip
    info = WorkerInfo(name=name, node_id=node, pid=len(name), address="10.0.0.1", busy=False,
                      held=held)  # fmt: skip
    return PooledWorker(name=name, handle=_Handle(), node_id=node, info=info)


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> WorkerPool:
    monkeypatch.setattr(WorkerPool, "__post_init__", lambda self: None)
    pool = WorkerPool(namespace="ns", warm_per_node=0, token="pool-token")
    for w in (_worker("a", "n1", held_step=20), _worker("b", "n2", held_step=20)):
        pool.workers[w.name] = w
    return pool


def _driver(pool: WorkerPool, wakes: list[None], *, attempt: int = 2) -> AttemptDriver:
    request = LaunchRequest(
        job_id=JOB.job_id, attempt=attempt, world_size=2, name=f"job-7-{attempt}",
        spec=JobSpec.model_validate(spec_dict()), storage_path="/tmp/x", database=JOB.database,
        cause="node lost",
    )  # fmt: skip
    return AttemptDriver(request, pool=pool, runtime_name="rt", namespace="ns",
                         collective_timeout_s=30.0, capability="cap",
                         wake=lambda: wakes.append(None))  # fmt: skip


def _phases(d: AttemptDriver) -> list[Phase]:
    """The timeline marks so far (sent with the first step, as one `Timeline`)."""
    return list(d._marks)


def _formed(pool: WorkerPool, monkeypatch: pytest.MonkeyPatch) -> tuple[AttemptDriver, _Cluster]:
    """A driver whose ranks were handed their parts."""
    cluster = _Cluster(monkeypatch, ["n1", "n2"])
    wakes: list[None] = []
    d = _driver(pool, wakes)
    d.advance()
    cluster.asked[-1].ref.answer(None)  # placed
    d.advance()
    d.workers[0].handle.refs["host_store"].answer(29500)
    d.advance()
    assert d.step == Step.RUN
    return d, cluster


def test_a_start_moves_on_each_reply_and_marks_every_phase(
    pool: WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = _Cluster(monkeypatch, ["n1", "n2"])
    wakes: list[None] = []
    d = _driver(pool, wakes)
    assert d.advance() and d.step == Step.RESERVE  # nothing of the job runs: placing at once
    assert [pg.where for pg in cluster.asked] == [Where.PREFERRED]  # where its state is
    assert not d.advance()  # nothing came back: nothing moves

    cluster.asked[-1].ref.answer(None)  # placed
    assert wakes  # the reply woke the loop
    assert d.advance() and d.step == Step.FORM  # warm processes: up at once
    rank0 = d.workers[0].handle
    assert rank0.called("host_store") and all(w.busy for w in d.workers)

    rank0.refs["host_store"].answer(29500)
    assert d.advance() and d.step == Step.RUN
    assignments = [w.handle.calls[-1][1][1] for w in d.workers]
    assert [(a.rank, a.master_port) for a in assignments] == [(0, 29500), (1, 29500)]
    assert _phases(d) == [Phase.DETECTED, Phase.OLD_GROUP_STOPPED, Phase.PLACED,
                          Phase.PROCESSES_UP]  # fmt: skip
    report = d.drain(0)
    assert report.status == DriverStatus.STARTING and isinstance(report.placement, Placement)
    assert d._marks[Phase.PLACED].detail == "2 processes: 2 warm, 2 holding the job's state"

    for rank, w in enumerate(d.workers):
        w.handle.refs["run"].answer(RunOutcome(rank=rank, final_step=30))
    assert d.advance() and d.finished
    assert d.drain(0).status == DriverStatus.SUCCEEDED
    assert not any(w.busy for w in d.workers)  # back in the pool


def test_the_old_group_is_waited_for_then_its_processes_are_taken(
    pool: WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = _Cluster(monkeypatch, ["n1", "n2"])
    old, wakes = pool.workers["a"], []
    pool.take(old, (7, 1), JOB)  # type: ignore[arg-type]
    d = _driver(pool, wakes)
    d.advance()
    assert d.step == Step.OLD_GROUP and not cluster.asked and d.wake_at is not None
    pool.give_back(old, old.held, alive=True)  # the old attempt's rank came back
    assert d.advance() and d.step == Step.RESERVE
    stopped = d._marks[Phase.OLD_GROUP_STOPPED]
    assert stopped.at == old.returned_at and stopped.detail == ""


def _survivor_lets_go(d: AttemptDriver, survivor: PooledWorker) -> Any:
    """Rank 0 ends with its peer lost; the attempt's report, which must name rank 1's
    node as dead."""
    peer = WorkerError(type="DistBackendError", message="peer", kind=ErrorKind.PEER_LOST)
    survivor.handle.refs["run"].answer(RunOutcome(rank=0, error=peer))
    d.advance()
    report = d.drain(0)
    assert report.status == DriverStatus.FAILED and report.error is not None
    assert (report.error.kind, report.error.rank) == (ErrorKind.NODE_DIED, 1)
    return report


def test_a_rank_that_dies_fails_the_attempt_after_the_node_probe(
    pool: WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone: set[str] = set()
    monkeypatch.setattr(collect, "raylet_gone", lambda node: node in gone)
    d, _ = _formed(pool, monkeypatch)
    survivor, lost = d.workers
    gone.add("n2")  # its raylet, and with it its process
    lost.handle.refs["run"].die()
    d.advance()
    assert d.step == Step.RUN  # its node is being probed (on a thread of its own)
    d._outcomes.probes["n2"].result(timeout=5)
    _survivor_lets_go(d, survivor)
    assert lost.name not in pool.workers and not survivor.busy


def test_a_rank_whose_raylet_died_ends_as_a_node_loss_before_ray_says_so(
    pool: WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n2's raylet died; rank 1's process there trains on (or is gone, its calls neither
    answering nor failing until Ray's health checks fail the node): the driver probes its
    ranks' nodes while they run, and n2's refusal ends rank 1 as a node loss at once."""
    monkeypatch.setattr(collect, "raylet_gone", lambda node: node == "n2")
    d, _ = _formed(pool, monkeypatch)
    survivor, lost = d.workers
    d.advance()  # probes of n1 and n2 go out
    probes = d._outcomes._watched
    assert set(probes) == {"n1", "n2"}
    assert not probes["n1"][0].result(timeout=5) and probes["n2"][0].result(timeout=5)
    d.advance()
    assert lost.handle.called("abort")  # if its process lives on, it lets go
    assert survivor.handle.called("abort")  # its peer ended badly: told to let go at once
    report = _survivor_lets_go(d, survivor)
    assert "refuses connections" in report.error.message
    assert lost.name not in pool.workers and not survivor.busy


def test_the_nodes_are_probed_again_through_the_grace_of_a_bad_outcome(
    pool: WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its peers ended badly first (their collective with it broke) while n2's raylet
    still answered: the driver keeps waking and probing, and finds it gone a second later."""
    gone: set[str] = set()
    monkeypatch.setattr(collect, "raylet_gone", lambda node: node in gone)
    d, _ = _formed(pool, monkeypatch)
    survivor, lost = d.workers
    d.advance()
    d._outcomes._watched["n2"][0].result(timeout=5)
    peer = WorkerError(type="DistBackendError", message="peer", kind=ErrorKind.PEER_LOST)
    survivor.handle.refs["run"].answer(RunOutcome(rank=0, error=peer))
    d.advance()
    assert lost.handle.called("abort") and d.step == Step.RUN  # let go; no answer yet
    assert d._state.poll_at is not None  # the driver still wakes to poll and probe
    gone.add("n2")
    mono = time.monotonic()
    monkeypatch.setattr(driver_module.time, "monotonic", lambda: mono + 2)
    d.advance()
    assert d._outcomes._watched["n2"][0].result(timeout=5)
    d.advance()
    report = d.drain(0)
    assert report.status == DriverStatus.FAILED and report.error is not None
    assert (report.error.kind, report.error.rank) == (ErrorKind.NODE_DIED, 1)


def test_a_rank_that_never_lets_go_is_given_up_and_taken_back_when_it_does(
    pool: WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, _ = _formed(pool, monkeypatch)
    ok, stuck = d.workers
    peer = WorkerError(type="DistBackendError", message="peer", kind=ErrorKind.PEER_LOST)
    ok.handle.refs["run"].answer(RunOutcome(rank=0, error=peer))
    d.advance()
    assert d._state.grace_until is not None and d.step == Step.RUN
    clock = driver_module.time.monotonic() + 60
    monkeypatch.setattr(driver_module.time, "monotonic", lambda: clock)
    assert d.advance() and d.step == Step.DONE and not d.finished  # one still out
    assert stuck.handle.called("abort") and stuck.busy
    assert d.drain(0).status == DriverStatus.FAILED
    stuck.handle.refs["run"].answer(RunOutcome(rank=1, aborted=True))
    assert d.advance() and d.finished and not stuck.busy


def test_a_release_while_placing_gives_everything_back(
    pool: WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = _Cluster(monkeypatch, ["n1", "n2"])
    d = _driver(pool, [])
    d.advance()
    d.release()
    assert cluster.removed == cluster.asked  # at once, by the release itself
    d.advance()
    report = d.drain(0)
    assert d.finished and report.status == DriverStatus.FAILED
    assert any(isinstance(m, WorkerFailed) for m in report.messages)
    assert not any(w.busy for w in pool.workers.values())


def test_a_release_before_the_ranks_ran_hands_the_processes_back(
    pool: WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = _Cluster(monkeypatch, ["n1", "n2"])
    d = _driver(pool, [])
    d.advance()
    cluster.asked[-1].ref.answer(None)
    d.advance()
    assert d.step == Step.FORM and all(w.busy for w in d.workers)
    d.release()
    d.workers[0].handle.refs["host_store"].answer(29500)
    d.advance()
    assert d.finished and not any(w.handle.called("run") for w in d.workers)
    assert not any(w.busy for w in pool.workers.values())


def test_an_ask_not_placed_in_time_is_asked_again_then_anywhere(
    pool: WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = _Cluster(monkeypatch, ["n1", "n2"])
    now = [1000.0]
    monkeypatch.setattr(driver_module.time, "monotonic", lambda: now[0])
    d = _driver(pool, [])
    d.advance()
    for _ in range(4):  # at 0.15 s, 0.45 s, 1.05 s; at 1.5 s the preferred nodes' time is up
        assert d.wake_at is not None
        now[0] = d.wake_at
        d.advance()
    assert [pg.where for pg in cluster.asked] == [Where.PREFERRED] * 4 + [Where.ANYWHERE]
    assert cluster.removed == cluster.asked[:4]  # each replaced ask was dropped


def test_an_ask_ray_is_placing_is_not_replaced(
    pool: WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray 2.60 leaks the bundles of a group removed while it prepared them on a node that
    died, and then places no later group (ray#64693): such an ask is left to end, and the
    next ask after it replaces it; placed meanwhile, it is the attempt's."""
    cluster = _Cluster(monkeypatch, ["n1", "n2"])
    now = [1000.0]
    monkeypatch.setattr(driver_module.time, "monotonic", lambda: now[0])
    d = _driver(pool, [])
    d.advance()
    cluster.asked[0].placing = True
    for _ in range(2):  # two asks due (0.15 s, 0.45 s): the group is being placed, kept
        assert d.wake_at is not None
        now[0] = d.wake_at
        d.advance()
    assert len(cluster.asked) == 1 and cluster.removed == []
    cluster.asked[0].placing = False  # pending again: the next ask replaces it
    assert d.wake_at is not None
    now[0] = d.wake_at
    d.advance()
    assert len(cluster.asked) == 2 and cluster.removed == cluster.asked[:1]
    cluster.asked[1].placing = True
    cluster.asked[1].ref.answer(None)  # placed while being placed: the attempt goes on
    d.advance()
    assert d.step != Step.RESERVE and cluster.removed == cluster.asked[:1]


@pytest.mark.parametrize(
    ("joined", "warm", "expected"),
    [
        pytest.param(0.0, 0.0, [(Phase.DETECTED, 100.0)], id="no-join: starts at the decision"),
        pytest.param(
            80.0,
            95.0,
            [(Phase.NODE_JOINED, 80.0), (Phase.PROCESS_WARM, 95.0), (Phase.DETECTED, 100.0)],
            id="grow-onto-a-joined-node: starts at the join",
        ),
        pytest.param(
            80.0, 0.0, [(Phase.NODE_JOINED, 80.0), (Phase.DETECTED, 100.0)], id="warm-not-known"
        ),
        pytest.param(
            80.0,
            101.0,
            [(Phase.NODE_JOINED, 80.0), (Phase.PROCESS_WARM, 100.0), (Phase.DETECTED, 100.0)],
            id="another-clock-past-the-decision: clamped",
        ),
    ],
)
def test_a_grows_timeline_starts_when_its_node_joined(
    pool: WorkerPool, joined: float, warm: float, expected: list[tuple[Phase, float]]
) -> None:
    request = LaunchRequest(
        job_id=JOB.job_id, attempt=3, world_size=3, name="job-7-3", cause="resize",
        spec=JobSpec.model_validate(spec_dict()), storage_path="/tmp/x", database=JOB.database,
        detected_at=100.0, joined_at=joined, warm_at=warm,
    )  # fmt: skip
    d = AttemptDriver(request, pool=pool, runtime_name="rt", namespace="ns",
                      collective_timeout_s=30.0, capability="cap", wake=lambda: None)  # fmt: skip
    timeline = d._timeline()
    assert [(m.phase, m.at) for m in timeline.marks] == expected
    assert timeline.phases()[0]["since_start_s"] == 0.0


def test_the_placing_state_is_one_ray_reports() -> None:
    """`being_placed` reads Ray's placement-group stats by name: a Ray that renames the
    state would leave every ask replaceable again, silently."""
    from ray.core.generated import gcs_pb2

    names = [v.name for v in gcs_pb2.PlacementGroupStats.SchedulingState.DESCRIPTOR.values]
    assert "SCHEDULING_STARTED" in names
