"""The runtime's pure choices: which process takes a rank, how many to keep warm, which
error explains a failed attempt."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from elastrain.contracts.group import HeldState, WorkerInfo
from elastrain.contracts.messages import ErrorKind, WorkerError
from elastrain.contracts.runtime import AttemptKey, JobRef
from elastrain.contracts.spec import JobSpec
from elastrain.workers.runtime.placement import private_worker_options
from elastrain.workers.runtime.pool import (
    PooledWorker,
    WorkerPool,
    choose_worker,
    gpus_to_start,
    spares_to_start,
    surplus_gpu_workers,
    warm_target,
)
from elastrain.workers.runtime.verdict import cause_of
from tests.factories import spec_dict


def worker(name: str, *, held: tuple[int, int] | None = None, busy: bool = False,
           started: bool = True, private: bool = False, database: str = "db",
           gpu: int | None = None) -> PooledWorker:  # fmt: skip
    state = None
    if held is not None:
        state = HeldState(job_id=held[0], step=held[1], world_size=2, full_replica=True,
                          database=database)  # fmt: skip
    info = WorkerInfo(name=name, node_id="n", pid=1, address="a", busy=busy, held=state, gpu=gpu)
    return PooledWorker(name=name, handle=None, node_id="n", info=info if started else None,
                        busy=busy, private=private, gpu=gpu)  # fmt: skip


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        pytest.param([], None, id="none"),
        pytest.param(
            [worker("a", busy=True), worker("b", started=False)],
            None,
            id="busy-and-starting-are-not-candidates",
        ),
        pytest.param(
            [worker("other", held=(9, 50)), worker("empty")],
            "empty",
            id="an-empty-process-before-another-jobs-state",
        ),
        pytest.param(
            [worker("empty"), worker("old", held=(7, 10)), worker("new", held=(7, 20))],
            "new",
            id="the-newest-state-of-this-job-first",
        ),
        pytest.param(
            [worker("other", held=(9, 50))], "other", id="another-jobs-process-when-nothing-else"
        ),
        pytest.param(
            [worker("new", held=(7, 20), busy=True), worker("old", held=(7, 10))],
            "old",
            id="a-busy-holder-is-not-taken",
        ),
        pytest.param(
            [worker("empty"), worker("other-db", held=(7, 30), database="old")],
            "empty",
            id="job-7-of-another-database-is-another-job",
        ),
        pytest.param(
            [worker("pip", held=(7, 30), private=True), worker("empty")],
            "empty",
            id="a-private-process-is-never-lent-again",
        ),
    ],
)
def test_choose_worker(candidates: list[PooledWorker], expected: str | None) -> None:
    chosen = choose_worker(candidates, JobRef("db", 7))
    assert (chosen.name if chosen else None) == expected


@pytest.mark.parametrize(
    ("candidates", "gpu", "expected"),
    [
        pytest.param([worker("gpu0", gpu=0)], False, None, id="a-cpu-rank-never-takes-a-gpu-process"),
        pytest.param([worker("cpu")], True, None, id="a-gpu-rank-never-takes-a-cpu-process"),
        pytest.param(
            [worker("cpu", held=(7, 30)), worker("gpu1", gpu=1)], True, "gpu1",
            id="a-gpu-rank-takes-a-gpu-process-over-a-cpu-one-holding-its-state",
        ),
        pytest.param(
            [worker("gpu0", gpu=0, busy=True), worker("gpu1", gpu=1, held=(9, 5))], True, "gpu1",
            id="a-busy-gpu-process-is-not-shared",
        ),
        pytest.param(
            [worker("gpu0", gpu=0), worker("gpu1", gpu=1, held=(7, 12))], True, "gpu1",
            id="a-gpu-process-holding-the-jobs-state-first",
        ),
    ],
)  # fmt: skip
def test_choose_worker_by_kind(
    candidates: list[PooledWorker], gpu: bool, expected: str | None
) -> None:
    chosen = choose_worker(candidates, JobRef("db", 7), gpu=gpu)
    assert (chosen.name if chosen else None) == expected


@pytest.mark.parametrize(
    ("node_gpus", "owners", "expected"),
    [
        (0, [], []),
        (2, [], [0, 1]),
        (2, [worker("a", gpu=1, busy=True)], [0]),  # a busy owner still owns its GPU
        (2, [worker("a", gpu=0, started=False), worker("b", gpu=1)], []),  # starting counts
        (1, [worker("a", gpu=0), worker("b", gpu=0)], []),
    ],
)
def test_gpus_to_start(node_gpus: float, owners: list[PooledWorker], expected: list[int]) -> None:
    assert gpus_to_start(node_gpus, owners) == expected


@pytest.mark.parametrize(
    ("owners", "expected"),
    [
        pytest.param([worker("a", gpu=0), worker("b", gpu=1)], [], id="one-per-gpu"),
        pytest.param(
            [worker("stuck", gpu=0, busy=True), worker("spare", gpu=0)], ["spare"],
            id="an-idle-second-process-goes-its-gpu-memory-is-wanted",
        ),
        pytest.param(
            [worker("old", gpu=0, held=(7, 10)), worker("new", gpu=0, held=(7, 20))], ["old"],
            id="the-one-holding-the-newest-state-stays",
        ),
        pytest.param(
            [worker("busy", gpu=0, busy=True), worker("x", gpu=0), worker("y", gpu=0)], ["x", "y"],
            id="a-busy-one-stays-the-idle-rest-go",
        ),
        pytest.param(
            [worker("a", gpu=0), worker("b", gpu=0, started=False)], [],
            id="not-while-one-is-starting",
        ),
    ],
)  # fmt: skip
def test_surplus_gpu_workers(owners: list[PooledWorker], expected: list[str]) -> None:
    assert [w.name for w in surplus_gpu_workers(owners)] == expected


def _cpu(*, busy: bool = False, started: bool = True, private: bool = False) -> PooledWorker:
    return worker("w", busy=busy, started=started, private=private)


@pytest.mark.parametrize(
    ("procs", "expected"),
    [
        pytest.param([], 2, id="a-new-node: up to the warm target"),
        pytest.param([_cpu(started=False)], 1, id="one-starting-for-nobody: the other"),
        pytest.param([_cpu(busy=True), _cpu()], 0, id="one-lent-one-idle: at the target"),
        pytest.param([_cpu(busy=True), _cpu(busy=True)], 1, id="both-lent: the one spare"),
        pytest.param(
            [_cpu(busy=True, started=False), _cpu(busy=True)],
            0,
            id="a-rank-waits-for-one-starting: no spare beside it yet",
        ),
        pytest.param(
            [_cpu(busy=True, started=False, private=True)], 0, id="a-private-one-starting"
        ),
    ],
)
def test_spares_to_start(procs: list[PooledWorker], expected: int) -> None:
    assert spares_to_start(procs, node_cpus=2, per_node=2) == expected


@pytest.mark.parametrize(
    ("node_cpus", "busy", "per_node", "expected"),
    [
        (1, 0, 2, 1),  # no more idle processes than CPUs
        (1, 1, 2, 1),  # the one CPU is busy: one spare all the same
        (4, 1, 2, 2),
        (4, 3, 2, 1),
        (4, 4, 2, 1),
        (0.5, 0, 2, 1),  # a fractional CPU still runs one
        (8, 0, 0, 0),  # warm pool off
    ],
)
def test_warm_target(node_cpus: float, busy: int, per_node: int, expected: int) -> None:
    assert warm_target(node_cpus=node_cpus, busy=busy, per_node=per_node) == expected


# The kind decides, not the text: ECHO's message says nothing of a peer, OWN's does.
ECHO = WorkerError(type="RuntimeError", kind=ErrorKind.PEER_LOST, message="read error", rank=0)
OWN = WorkerError(type="ValueError", message="Connection reset by peer in my data", rank=1)
DIED = WorkerError(
    type="ActorDiedError", kind=ErrorKind.PROCESS_DIED, message="the process died", rank=2
)
STUCK = WorkerError(type="WorkerStuck", kind=ErrorKind.STUCK, message="did not let go", rank=0)
CONFIG = WorkerError(type="WorkloadError", kind=ErrorKind.CONFIGURATION, message="x", rank=3)


@pytest.mark.parametrize(
    ("errors", "expected"),
    [
        ([ECHO, DIED], DIED),  # a dead process explains its peers' broken collectives
        ([ECHO, OWN], OWN),  # a real error before an echo of it
        ([ECHO], ECHO),  # nothing better
        ([OWN, DIED], DIED),
        ([STUCK, OWN], OWN),  # a rank hung behind a failed one is not the cause
        ([ECHO, STUCK], ECHO),  # only echoes: the first
        ([ECHO, CONFIG, OWN], CONFIG),
    ],
)
def test_cause_of(errors: list[WorkerError], expected: WorkerError) -> None:
    assert cause_of(errors) == expected


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        pytest.param({}, None, id="cpu-job-uses-the-warm-pool"),
        pytest.param(
            {"scaling": {"use_gpu": True, "gpus_per_worker": 1}},
            None,
            id="gpu-job-uses-the-warm-gpu-processes",
        ),
        pytest.param(
            {"workload": {"entrypoint": "m:f", "requirements": ["einops==0.8.1"]}},
            {"runtime_env": {"pip": ["einops==0.8.1"]}},
            id="pip-requirements-start-in-their-environment",
        ),
    ],
)
def test_private_worker_options(overrides: dict, expected: dict | None) -> None:  # type: ignore[type-arg]
    spec = JobSpec.model_validate(spec_dict(**overrides))
    assert private_worker_options(spec) == expected


# -- processes that ran a job's own code -----------------------------------------------------

JOB_A, JOB_B = JobRef("db", 1), JobRef("db", 2)


def dedicated(name: str, to: JobRef, **kw: Any) -> PooledWorker:
    w = worker(name, **kw)
    w.dedicated_to = to
    return w


@pytest.mark.parametrize(
    ("candidates", "job", "expected"),
    [
        pytest.param([dedicated("a", JOB_A)], JOB_B, None, id="never-lent-to-another-job"),
        pytest.param([dedicated("a", JOB_A)], JOB_A, "a", id="lent-to-its-own-job"),
        pytest.param(
            [dedicated("a", JOB_A, held=(1, 5)), worker("clean")],
            JOB_B,
            "clean",
            id="a-clean-process-for-the-other-job",
        ),
    ],
)
def test_a_process_that_ran_a_jobs_code_serves_that_job_alone(
    candidates: list[PooledWorker], job: JobRef, expected: str | None
) -> None:
    chosen = choose_worker(candidates, job)
    assert (chosen.name if chosen else None) == expected


def test_a_job_runs_its_own_code_with_a_package_or_an_entrypoint() -> None:
    built_in = JobSpec.model_validate(spec_dict())
    assert not built_in.workload.runs_own_code
    custom = JobSpec.model_validate(
        spec_dict(workload={"entrypoint": "my_pkg.train:make", "package": "sha256:" + "a" * 64})
    )
    assert custom.workload.runs_own_code


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> tuple[WorkerPool, list[Any]]:
    killed: list[Any] = []
    monkeypatch.setattr(WorkerPool, "__post_init__", lambda self: None)
    monkeypatch.setattr("elastrain.workers.runtime.pool.ray.kill", killed.append)
    return WorkerPool(namespace="ns", warm_per_node=1, token="pool-token"), killed


class _Handle:
    def __init__(self, name: str) -> None:
        self.name = name
        self.forget = self  # `handle.forget.remote(token)`

    def remote(self, token: str) -> None:
        assert token == "pool-token"  # every call into a process carries the pool's token


def _lent(pool: WorkerPool, name: str, job: JobRef, *, own_code: bool) -> PooledWorker:
    w = worker(name)
    w.handle = _Handle(name)
    pool.workers[name] = w
    pool.take(w, AttemptKey(job.job_id, 1), job, own_code=own_code)
    return w


def test_when_the_job_ends_its_code_running_processes_stop_and_the_others_stay(
    pool: tuple[WorkerPool, list[Any]],
) -> None:
    workers, killed = pool
    running = _lent(workers, "running", JOB_A, own_code=True)
    idle = _lent(workers, "idle", JOB_A, own_code=True)
    workers.give_back(idle, None, alive=True)
    built_in = _lent(workers, "built-in", JOB_B, own_code=False)
    workers.give_back(built_in, None, alive=True)

    workers.forget_job(JOB_A)  # job A ended: its idle process stops at once
    assert [h.name for h in killed] == ["idle"] and "running" in workers.workers
    workers.give_back(running, None, alive=True)  # ... the busy one when it comes back
    assert [h.name for h in killed] == ["idle", "running"]
    workers.forget_job(JOB_B)
    assert set(workers.workers) == {"built-in"}  # a built-in job's process serves on


def test_a_node_is_ready_once_a_process_answered_there(
    pool: tuple[WorkerPool, list[Any]],
) -> None:
    workers, _ = pool
    workers.node_gpus = {"cpu-new": 0.0, "cpu-up": 0.0, "gpu-new": 1.0, "gpu-up": 1.0}
    for node, gpu, started in [
        ("cpu-new", None, False),
        ("cpu-up", None, True),
        ("gpu-new", None, True),  # its CPU process answered, its GPU owner not yet
        ("gpu-new", 0, False),
        ("gpu-up", 0, True),
    ]:
        w = worker(f"{node}-{gpu}", started=started, gpu=gpu)
        w.node_id = node
        workers.workers[w.name] = w
    assert workers.ready_nodes() == {"cpu-up", "gpu-up"}
    workers.warm_per_node = 0  # no warm processes kept: nothing to wait for on CPU nodes
    assert workers.ready_nodes() == {"cpu-new", "cpu-up", "gpu-up"}


class _Starting:
    """A started process's handle: its first answer arrives when the test says so."""

    def __init__(self) -> None:
        self.answer: Future[WorkerInfo] = Future()
        self.describe = self

    def remote(self) -> Any:
        return self

    def future(self) -> Future[WorkerInfo]:
        return self.answer


class _Class:
    """`ray.remote(WorkerProcess)`: what each start asked for."""

    def __init__(self) -> None:
        self.started: list[tuple[_Starting, bool]] = []

    def options(self, **_: Any) -> _Class:
        return self

    def remote(self, name: str, gpu: int | None, digest: bytes, *, imports_ahead: bool) -> Any:
        self.started.append((_Starting(), imports_ahead))
        return self.started[-1][0]


def test_a_process_is_noticed_when_it_answers_taken_while_starting_and_spares_import_last(
    pool: tuple[WorkerPool, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    workers, _ = pool
    monkeypatch.setattr("elastrain.workers.runtime.pool.NodeAffinitySchedulingStrategy",
                        lambda node, soft: node)  # fmt: skip
    workers._cls = cls = _Class()
    first = workers.start("n1", spare=True)  # the node's first: a grow waits for it
    assert cls.started[-1][1] is True and workers.ready_nodes() == frozenset()
    assert workers.spare_cpu_worker("n1", []) is first  # a rank takes it, starts no other
    assert len(cls.started) == 1
    workers.node_gpus = {"n1": 0.0}
    cls.started[0][0].answer.set_result(
        WorkerInfo(name=first.name, node_id="n1", pid=1, address="a", busy=False, warm_at=42.0)
    )  # noticed at once, not at the next upkeep pass
    assert first.idle and workers.ready_nodes() == {"n1"} and workers.warm_at() == {"n1": 42.0}
    workers.start("n1", spare=True)  # a spare beside a warm one: nothing waits for it
    assert cls.started[-1][1] is False
    workers.start("n1")  # a rank waits for it
    assert cls.started[-1][1] is True
    workers.take(first, AttemptKey(7, 1), JOB_A)
    assert workers.spare_cpu_worker("n1", []).info is None  # one still starting there
    assert len(cls.started) == 3
    for _ in range(2):  # the two still starting
        workers.take(workers.spare_cpu_worker("n1", []), AttemptKey(7, 1), JOB_A)
    workers.spare_cpu_worker("n1", [])  # every process there is lent: a new one
    assert len(cls.started) == 4 and cls.started[-1][1] is True
    failed = workers.start("n2", spare=True)
    cls.started[-1][0].answer.set_exception(RuntimeError("died in its imports"))
    assert failed.info is None  # left to the upkeep pass, which says why and forgets it
