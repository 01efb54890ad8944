"""A command job's rank without Ray: the environment its script gets, the report channel
from `elastrain.workers.user_api.report` through a real pipe, and real scripts run by `ScriptRun`
(exit codes, stderr tails, stop and abort)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from elastrain.contracts.group import Assignment
from elastrain.contracts.messages import Control, Phase, StepMetrics, TimelineMark, WorkerMessage
from elastrain.contracts.spec import JobSpec
from elastrain.workers.command import (
    LINE_HOLD_BYTES,
    ScriptRun,
    command_argv,
    command_env,
    copy_whole_lines,
    parse_report,
)
from elastrain.workers.errors import script_error_kind
from elastrain.workers.runtime.layout import local_layout

REPO = Path(__file__).resolve().parents[2]


def assignment(command: list[str], *, rank: int = 0, world: int = 2, attempt: int = 3,
               **layout: int) -> Assignment:  # fmt: skip
    spec = JobSpec.model_validate(
        {
            "name": "cmd",
            "workload": {"command": command, "package": "sha256:" + "0" * 64},
            "failure": {"max_restarts": 7},
        }
    )
    return Assignment(
        job_id=42, attempt=attempt, rank=rank, world_size=world, master_addr="10.0.0.5",
        master_port=29511, spec=spec, storage_path="/s", database="main", runtime_name="rt",
        namespace="ns", collective_timeout_s=30, **layout,
    )  # fmt: skip


def test_the_environment_is_torchruns_plus_the_job_dir() -> None:
    a = assignment(["python", "-c", "1"], rank=3, world=4, local_rank=1, local_world_size=2,
                   group_rank=1, group_world_size=2)  # fmt: skip
    env = command_env(a, base={"PATH": "/bin", "ELASTRAIN_REPORT_FD": "9"},
                      job_dir=Path("/s/jobs/42/files"), report_fd=None)  # fmt: skip
    assert {k: env[k] for k in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_USE_AGENT_STORE", "ELASTRAIN_JOB_DIR",
    )} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29511", "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "7", "TORCHELASTIC_USE_AGENT_STORE": "True",
        "ELASTRAIN_JOB_DIR": "/s/jobs/42/files",
    }  # fmt: skip
    assert env["TORCHELASTIC_RUN_ID"] == "elastrain-main-42"
    assert env["PATH"] == "/bin"
    assert "ELASTRAIN_REPORT_FD" not in env  # only rank 0's script reports, through its own pipe
    first = command_env(assignment(["x"], attempt=1), base={}, job_dir=Path("/j"), report_fd=7)
    assert first["TORCHELASTIC_RESTART_COUNT"] == "0" and first["ELASTRAIN_REPORT_FD"] == "7"


def test_a_script_gets_no_ray_nor_service_variables() -> None:
    """A command is the tenant's code: the cluster's addresses, sockets and credentials in
    its worker's environment (a local Ray's, KubeRay's, an operator's) never reach it."""
    worker = {
        "PATH": "/bin",
        "HF_HOME": "/cache/hf",
        "RAY_ADDRESS": "10.0.0.1:6379",
        "RAY_RAYLET_PID": "123",
        "RAY_JOB_ID": "01000000",
        "RAYLET_SOCKET_NAME": "/tmp/ray/sockets/raylet",
        "FQ_RAY_IP": "head.svc",
        "REDIS_PASSWORD": "s3cret",
        "ELASTRAIN_PACKAGE_CACHE": "/tmp/p",
    }
    env = command_env(assignment(["x"]), base=worker, job_dir=Path("/j"), report_fd=None)
    assert not [k for k in env if k.startswith(("RAY", "REDIS")) or k == "FQ_RAY_IP"], env
    assert env["PATH"] == "/bin" and env["HF_HOME"] == "/cache/hf"  # the user's own stay
    assert [k for k in env if k.startswith("ELASTRAIN_")] == ["ELASTRAIN_JOB_DIR"]


def test_ranks_are_numbered_node_by_node() -> None:
    layout = local_layout(["a", "a", "b", "c", "c"])
    assert [(x["local_rank"], x["local_world_size"], x["group_rank"]) for x in layout] == [
        (0, 2, 0), (1, 2, 0), (0, 1, 1), (0, 2, 2), (1, 2, 2),
    ]  # fmt: skip
    assert {x["group_world_size"] for x in layout} == {3}


def test_python_is_the_workers_own_interpreter() -> None:
    assert command_argv(["python3", "t.py", "--lr", "1"], python="/venv/py") == [
        "/venv/py", "t.py", "--lr", "1",
    ]  # fmt: skip
    assert command_argv(["./run.sh", "python"], python="/venv/py") == ["./run.sh", "python"]


def test_report_lines_through_a_real_pipe() -> None:
    """`report` in a child process writes to the fd it was given; the lines read back are
    the points sent on (NaN as a gap, tensors as numbers, custom names kept)."""
    read_fd, write_fd = os.pipe()
    script = textwrap.dedent("""
        import torch
        from elastrain.workers.user_api import report, job_dir
        report(1, loss=torch.tensor(0.5), acc=0.75)
        report(2, loss=float("nan"), tokens=10)
        report(3)
        print(job_dir())
    """)
    env = {**os.environ, "ELASTRAIN_REPORT_FD": str(write_fd), "ELASTRAIN_JOB_DIR": "/jd",
           "PYTHONPATH": str(REPO)}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", script], env=env, pass_fds=(write_fd,),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    os.close(write_fd)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "/jd"
    with os.fdopen(read_fd, "rb") as lines:
        points = [parse_report(line, world_size=2) for line in lines]
    assert [(p.step, p.loss, p.custom) for p in points] == [
        (1, 0.5, {"acc": 0.75}), (2, None, {"tokens": 10}), (3, None, {}),
    ]  # fmt: skip
    assert all(p.world_size == 2 for p in points)


def test_report_outside_a_job_does_nothing_and_refuses_non_numbers() -> None:
    script = textwrap.dedent("""
        from elastrain.workers.user_api import report, ReportError
        report(1, loss=0.1)  # no ELASTRAIN_REPORT_FD: nothing, no error
        for bad in (lambda: report(-1), lambda: report(1, loss="x"), lambda: report(1.5)):
            try:
                bad()
            except ReportError:
                pass
            else:
                raise SystemExit("accepted")
    """)
    env = {k: v for k, v in os.environ.items() if k != "ELASTRAIN_REPORT_FD"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "line",
    [b"[1]", b'{"loss": 1}', b'{"step": -1}', b'{"step": 1, "loss": "x"}',
     b'{"step": 1, "acc": [1]}', b"not json"],
)  # fmt: skip
def test_lines_that_are_not_points_are_refused(line: bytes) -> None:
    with pytest.raises(ValueError):
        parse_report(line, world_size=1)


class Sink:
    def __init__(self) -> None:
        self.messages: list[WorkerMessage] = []

    def __call__(self, message: WorkerMessage) -> None:
        self.messages.append(message)


def run_script(tmp_path: Path, code: str, *, controls: list[Control] | None = None,
               abort: threading.Event | None = None, rank: int = 0):  # type: ignore[no-untyped-def]  # fmt: skip
    (tmp_path / "pkg").mkdir(exist_ok=True)
    (tmp_path / "pkg" / "s.py").write_text(textwrap.dedent(code))
    queue = list(controls or [])
    sink = Sink()
    os.environ.setdefault("PYTHONPATH", str(REPO))
    run = ScriptRun(
        assignment(["python", "s.py", "--flag"], rank=rank),
        cwd=tmp_path / "pkg",
        job_dir=tmp_path / "job",
        log_path=tmp_path / "logs" / "rank.log",
        send=sink if rank == 0 else None,
        abort=abort or threading.Event(),
        take_control=lambda: queue.pop(0) if queue else Control.NONE,
    )
    return run.wait(), sink, (tmp_path / "logs" / "rank.log").read_text()


def test_a_script_that_succeeds_reports_and_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    result, sink, log = run_script(
        tmp_path,
        """
        import os, sys
        from elastrain.workers.user_api import report, job_dir
        print("args", sys.argv[1:], os.environ["RANK"], os.environ["WORLD_SIZE"])
        print("to stderr", file=sys.stderr)
        for step in (1, 2):
            report(step, loss=1.0 / step)
        (job_dir() / "mine.txt").write_text("kept")
    """,
    )
    assert result.returncode == 0 and not result.stopped and not result.aborted
    assert result.last_step == 2
    assert "args ['--flag'] 0 2" in log and "to stderr" in log
    assert (tmp_path / "job" / "mine.txt").read_text() == "kept"
    marks = [m for m in sink.messages if isinstance(m, TimelineMark)]
    points = [m for m in sink.messages if isinstance(m, StepMetrics)]
    assert [m.phase for m in marks] == [Phase.FIRST_STEP]
    assert [(p.step, p.loss) for p in points] == [(1, 1.0), (2, 0.5)]


class Chunks(io.RawIOBase):
    """A pipe's reads as they came: `read1` gives one chunk at a time."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    def readable(self) -> bool:
        return True

    def read1(self, size: int = -1) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


@pytest.mark.parametrize(
    ("chunks", "writes"),
    [
        ([b"args", b" ", b"[1]", b"\n"], [b"args [1]\n"]),
        ([b"a\nb", b"c\n"], [b"a\n", b"bc\n"]),
        ([b"one\ntwo\n"], [b"one\ntwo\n"]),
        ([b"10%\r", b"20%\r", b"done\n"], [b"10%\r", b"20%\r", b"done\n"]),
        ([b"no end"], [b"no end"]),
        ([b"x" * LINE_HOLD_BYTES, b"y\n"], [b"x" * LINE_HOLD_BYTES, b"y\n"]),
        ([], []),
    ],
)  # fmt: skip
def test_a_stream_is_copied_in_whole_lines(chunks: list[bytes], writes: list[bytes]) -> None:
    got: list[bytes] = []
    tail: list[bytes] = []
    copy_whole_lines(Chunks(chunks), got.append, also=tail.append)  # type: ignore[arg-type]
    assert got == writes and tail == writes


def test_stdout_and_stderr_lines_never_mix_in_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    _, _, log = run_script(
        tmp_path,
        """
        import sys
        for i in range(300):
            print("out", i, "of", 300)
            print("err", i, "of", 300, file=sys.stderr)
    """,
    )
    lines = log.splitlines()
    assert sorted(lines) == sorted(
        [f"out {i} of 300" for i in range(300)] + [f"err {i} of 300" for i in range(300)]
    )


def test_a_failing_script_says_why_in_the_last_line_of_its_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    result, _, log = run_script(
        tmp_path,
        """
        print("before")
        1 / 0
    """,
    )
    assert result.returncode == 1
    assert result.failure_line() == "exit code 1: ZeroDivisionError: division by zero"
    assert "Traceback" in result.stderr_tail and "Traceback" in log
    assert script_error_kind(result.stderr_tail).value == "raised"


def test_stop_and_abort_end_the_script_and_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    code = """
        import subprocess, sys, time, pathlib
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        pathlib.Path("child.pid").write_text(str(child.pid))
        time.sleep(600)
    """
    t0 = time.monotonic()
    result, _, _ = run_script(tmp_path, code, controls=[Control.NONE] * 20 + [Control.STOP])
    assert result.stopped and result.returncode is None
    child = int((tmp_path / "pkg" / "child.pid").read_text())
    abort = threading.Event()
    threading.Timer(1.0, abort.set).start()
    result, _, _ = run_script(tmp_path, code, abort=abort, rank=1)
    assert result.aborted
    assert time.monotonic() - t0 < 30
    time.sleep(0.2)
    assert (
        not Path(f"/proc/{child}").exists()
        or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    )


def test_a_broken_collective_is_an_echo() -> None:
    gloo = ("Traceback...\nRuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
            "Connection closed by peer [10.0.0.2]:1234")  # fmt: skip
    assert script_error_kind(gloo).value == "peer_lost"
    assert (
        script_error_kind("torch.distributed.DistNetworkError: failed to recv").value == "peer_lost"
    )
    assert script_error_kind("ValueError: bad lr").value == "raised"
    assert json.dumps(script_error_kind("").value) == '"raised"'


def test_a_stopped_command_attempt_is_stopped_whatever_its_scripts_said() -> None:
    """On a resize every rank's script is stopped; one stopped first breaks its peers'
    collectives, and their non-zero exits are echoes of the stop, not a failure. A process
    that died is still a failure; a built-in job's verdict is unchanged."""
    from elastrain.contracts.group import RunOutcome
    from elastrain.contracts.messages import DriverStatus, ErrorKind, WorkerError
    from elastrain.workers.runtime.verdict import verdict as judge

    broke = WorkerError(type="ScriptFailed", message="exit code 1: gloo", kind=ErrorKind.RAISED)
    died = WorkerError(type="RayActorError", message="gone", kind=ErrorKind.PROCESS_DIED)
    stopped = [RunOutcome(rank=0, stopped_early=True), RunOutcome(rank=1, error=broke)]

    def verdict(command: bool, outcomes: list) -> DriverStatus:  # type: ignore[type-arg]
        return judge(outcomes, command=command)[0]

    assert verdict(True, stopped) == DriverStatus.STOPPED
    assert verdict(False, stopped) == DriverStatus.FAILED
    assert verdict(True, [RunOutcome(rank=0, stopped_early=True), died]) == DriverStatus.FAILED
    assert verdict(True, [RunOutcome(rank=0), RunOutcome(rank=1)]) == DriverStatus.SUCCEEDED


def test_a_script_dies_with_its_worker_process(tmp_path: Path) -> None:
    """The worker process SIGKILLed (its node lost, Ray killing it): its script goes too,
    rather than training on as an orphan that writes into the job's folder."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "s.py").write_text(
        "import os, pathlib, time\npathlib.Path('pid').write_text(str(os.getpid()))\ntime.sleep(600)\n"
    )
    worker = textwrap.dedent(f"""
        import threading, time
        from pathlib import Path
        from elastrain.contracts.messages import Control
        from tests.unit.test_command import assignment
        from elastrain.workers.command import ScriptRun
        tmp = Path({str(tmp_path)!r})
        run = ScriptRun(assignment(["python", "s.py"], rank=1), cwd=tmp / "pkg",
                        job_dir=tmp / "job", log_path=tmp / "rank.log", send=None,
                        abort=threading.Event(), take_control=lambda: Control.NONE)
        run.wait()
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", worker], cwd=REPO, env=env)
    pid_file = tmp_path / "pkg" / "pid"
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and parent.poll() is None, "the script never started"
        time.sleep(0.05)
    script = int(pid_file.read_text())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(script):
        assert time.monotonic() < deadline, f"script {script} outlived its worker process"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
