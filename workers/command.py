"""A command job's rank: the user's script as a child of the warm worker process.

`workload.command` (`["python", "train.py", "--lr", "3e-4"]`) runs on every rank of every
attempt with the environment torchrun gives its workers (`command_env`), in the job's
package (the `--working-dir`), so an unmodified torchrun script runs as is. Elasticity is
torchrun's `--nnodes=MIN:MAX`: the scheduler picks the world size of each attempt, every
rank's script restarts at it (TORCHELASTIC_RESTART_COUNT counts the attempts before), and
the script resumes from its own checkpoint in ELASTRAIN_JOB_DIR.

The rendezvous is the attempt's: rank 0's worker process hosts a TCPStore on a port the
OS picked (`elastrain.workers.rendezvous`), and every script connects to it as a client
(TORCHELASTIC_USE_AGENT_STORE, as under torchrun's agent), so no port is chosen free and
bound later by someone else.

Each script is a plain subprocess: a fork of the warm process itself (torch already
imported) would save its import time, but that process runs Ray's and torch's threads,
and a fork of it is not safe. What it prints is the job's log (stdout and stderr into the
rank's log file); the tail of its stderr explains a non-zero exit. Rank 0's script reports
points through a pipe (`elastrain.workers.user_api.report`), read here and sent on like the
built-in loop's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from elastrain.contracts.group import Assignment
from elastrain.contracts.messages import Control, Phase, StepMetrics, TimelineMark, WorkerMessage
from elastrain.contracts.os_identity import RunAs
from elastrain.contracts.spec import PYTHON_NAMES
from elastrain.workers.log_cap import CappedWriter
from elastrain.workers.user_api import JOB_DIR_ENV, REPORT_FD_ENV
from elastrain.workers.workloads import WorkloadError

log = logging.getLogger("elastrain.command")

#: How long a script has to exit after SIGTERM (stop, release) before SIGKILL.
TERM_GRACE_S = 5.0
#: How often the rank's thread looks at the script, the abort flag and the controls.
POLL_S = 0.05
#: Bytes of stderr kept for the error record of a failed script.
STDERR_TAIL_BYTES = 4000
#: The most bytes one report line may have; longer ones are dropped, said once in the log.
MAX_REPORT_LINE = 64 * 1024
#: The most bytes of one unfinished line held back before it is written as it is.
LINE_HOLD_BYTES = 64 * 1024
_SHIM = Path(__file__).with_name("command_shim.py")


def command_env(
    a: Assignment,
    *,
    base: Mapping[str, str],
    job_dir: Path,
    report_fd: int | None,
    visible_gpus: str | None = None,
) -> dict[str, str]:
    """The script's environment: the worker's, less what reaches the cluster's control
    (`script_base_env`), and what torchrun sets for its workers (names as in
    `torch.distributed.elastic.agent.server.local_elastic_agent`)."""
    env = script_base_env(base)
    env.update(
        {
            "RANK": str(a.rank),
            "LOCAL_RANK": str(a.local_rank),
            "WORLD_SIZE": str(a.world_size),
            "LOCAL_WORLD_SIZE": str(a.local_world_size),
            "GROUP_RANK": str(a.group_rank),
            "GROUP_WORLD_SIZE": str(a.group_world_size),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(a.rank),
            "ROLE_WORLD_SIZE": str(a.world_size),
            "MASTER_ADDR": a.master_addr,
            "MASTER_PORT": str(a.master_port),
            # Attempts start at 1; torchrun counts restarts from 0.
            "TORCHELASTIC_RESTART_COUNT": str(max(0, a.attempt - 1)),
            "TORCHELASTIC_MAX_RESTARTS": str(a.spec.failure.max_restarts),
            "TORCHELASTIC_RUN_ID": run_id(a),
            # Connect to the store rank 0's worker process hosts, as torchrun's workers
            # connect to their agent's: no script binds MASTER_PORT itself.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            JOB_DIR_ENV: str(job_dir),
        }
    )
    # torchrun's default when a node runs several workers: one thread each; here a rank
    # has `cpus_per_worker` CPUs.
    env.setdefault("OMP_NUM_THREADS", str(max(1, int(a.spec.scaling.cpus_per_worker))))
    # Lines reach the log as they are printed, not when a buffer fills.
    env.setdefault("PYTHONUNBUFFERED", "1")
    if report_fd is not None:
        env[REPORT_FD_ENV] = str(report_fd)
    if visible_gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_gpus
    return env


#: Variables a script never gets from its worker: Ray's (the cluster's addresses, ports,
#: session, credentials: `RAY_ADDRESS`, `RAY_RAYLET_PID`, KubeRay's `RAY_IP`/`FQ_RAY_IP`,
#: `REDIS_PASSWORD`) and the service's own (`ELASTRAIN_*` node settings; the script's
#: `ELASTRAIN_JOB_DIR` and report pipe are set anew). A script is the tenant's code: it
#: talks to its peers (MASTER_ADDR) and its own files, never to the cluster's control.
_SCRIPT_DROPPED_PREFIXES = ("RAY_", "RAYLET_", "ELASTRAIN_")
_SCRIPT_DROPPED = frozenset({"FQ_RAY_IP", "REDIS_PASSWORD", "REDIS_ADDRESS", "GCS_ADDRESS"})


def script_identity(a: Assignment) -> RunAs | None:
    """The OS identity `a`'s script runs as (None: the worker's own). Raises WorkloadError
    when there is one and this process cannot change user: a script never runs as the
    workers' user when the operator mapped its tenant to another."""
    if not a.run_as:
        return None
    run_as = RunAs.parse(a.run_as)
    if os.geteuid() != 0 and not _can_setuid():
        raise WorkloadError(
            f"workload.command: this job's tenant runs as {run_as} (ELASTRAIN_TENANT_USERS), "
            f"and the worker (uid {os.geteuid()}) cannot change user: run the workers as root "
            "or with CAP_SETUID"
        )
    return run_as


def _give(folder: Path, run_as: RunAs) -> None:
    """`folder` (the job's own files) to `run_as` alone (0700), entered through no link."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchown(fd, run_as.uid, run_as.gid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _can_setuid() -> bool:
    """CAP_SETUID and CAP_SETGID in this process's effective set (Linux)."""
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return False
    bits = int(caps.split()[1], 16)
    return bool(bits & (1 << 7)) and bool(bits & (1 << 6))  # CAP_SETUID, CAP_SETGID


def script_base_env(base: Mapping[str, str]) -> dict[str, str]:
    """`base` (the worker's environment) less Ray's and the service's variables."""
    return {
        name: value
        for name, value in base.items()
        if not name.startswith(_SCRIPT_DROPPED_PREFIXES) and name not in _SCRIPT_DROPPED
    }


def run_id(a: Assignment) -> str:
    """The same for every attempt of a job (torchrun's --rdzv-id), unique per database."""
    return f"elastrain-{a.database or 'db'}-{a.job_id}"


def command_argv(command: list[str], *, python: str = sys.executable) -> list[str]:
    """The argv to start: a `python`/`python3` program is the worker's own interpreter
    (the one with torch and the job's requirements)."""
    argv = list(command)
    if argv[0] in PYTHON_NAMES:
        argv[0] = python
    return argv


def parse_report(line: str | bytes, *, world_size: int) -> StepMetrics:
    """One line `elastrain.workers.user_api.report` wrote -> the point sent to the control plane.
    Raises ValueError for a line that is not a point."""
    point = json.loads(line)
    if not isinstance(point, dict):
        raise ValueError("a report line must be a JSON object")
    step = point.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    loss = point.get("loss")
    custom: dict[str, float | int | None] = {}
    for name, value in point.items():
        if name in ("step", "loss"):
            continue
        if not isinstance(name, str) or len(name) > 100:
            raise ValueError("metric names are strings of at most 100 characters")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{name} must be a number")
        custom[name] = value
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, int | float)):
        raise ValueError("loss must be a number")
    return StepMetrics(
        step=step,
        loss=None if loss is None else float(loss),
        world_size=world_size,
        dp=world_size,
        custom=custom,
    ).finite()


@dataclass(frozen=True, slots=True)
class ScriptResult:
    returncode: int | None
    """The exit status (negative: killed by that signal); None when it was stopped."""
    stopped: bool
    """Ended on a STOP/LEAVE control (a resize): the next attempt runs it again."""
    aborted: bool
    """Ended because the attempt was released (node loss, cancel)."""
    last_step: int | None
    stderr_tail: str

    def failure_line(self) -> str:
        """What went wrong, in one line: the last line of its stderr (a traceback's)."""
        lines = [ln.strip() for ln in self.stderr_tail.splitlines() if ln.strip()]
        code = self.returncode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                how = f"killed by {signal.Signals(-code).name}"
                return f"{how}: {lines[-1]}" if lines else how
        head = f"exit code {code}"
        return f"{head}: {lines[-1]}" if lines else head


def copy_whole_lines(
    stream: IO[bytes],
    write: Callable[[bytes], None],
    also: Callable[[bytes], None] | None = None,
) -> None:
    """Copies `stream` to `write` in whole lines until EOF.

    stdout and stderr are two pipes copied by two threads into one log, and an unbuffered
    Python (PYTHONUNBUFFERED, set above) writes `print("a", b)` as several writes: copied
    chunk by chunk, a stderr line lands inside a stdout line. A line is held until its end
    (a newline, or a carriage return, so progress bars still show), up to LINE_HOLD_BYTES.
    """
    held = b""
    while chunk := stream.read1(65536):  # type: ignore[attr-defined]
        data = held + chunk
        cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
        if cut == 0 and len(data) < LINE_HOLD_BYTES:
            held = data
            continue
        cut = cut or len(data)
        write(data[:cut])
        if also is not None:
            also(data[:cut])
        held = data[cut:]
    if held:
        write(held)
        if also is not None:
            also(held)


class ScriptRun:
    """One rank's script, from start to exit: `wait` returns how it ended."""

    def __init__(
        self,
        a: Assignment,
        *,
        cwd: Path,
        job_dir: Path,
        log_path: Path,
        send: Callable[[WorkerMessage], None] | None,
        abort: threading.Event,
        take_control: Callable[[], Control],
        visible_gpus: str | None = None,
    ) -> None:
        self.a = a
        self.send = send
        self.abort = abort
        self.take_control = take_control
        self.last_step: int | None = None
        self._tail: deque[bytes] = deque()
        self._tail_bytes = 0
        run_as = script_identity(a)  # before anything is made: a refusal leaves nothing
        job_dir.mkdir(parents=True, exist_ok=True)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # Both streams go through one capped writer (`workers.log_cap`): a script that
        # prints without end stops at the cap, with a note, and never fills the disk.
        self._log = CappedWriter(log_path)
        read_fd = write_fd = None
        if send is not None:
            read_fd, write_fd = os.pipe()
        env = command_env(
            a, base=os.environ, job_dir=job_dir, report_fd=write_fd, visible_gpus=visible_gpus
        )
        if run_as is not None:  # the tenant's own user, its files its own, home in them
            _give(job_dir, run_as)
            env["HOME"] = str(job_dir)
        # The shim drops to `run_as` (if any) and becomes the program (`command_shim`).
        argv = [sys.executable, "-S", str(_SHIM), str(os.getpid()), str(run_as or "-"),
                *command_argv(list(a.spec.workload.command or []))]  # fmt: skip
        try:
            self.proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(write_fd,) if write_fd is not None else (),
                start_new_session=True,  # its own process group: stopped with its children
            )
        except BaseException:
            self._log.close()
            if read_fd is not None:
                os.close(read_fd)  # the write end is closed below either way
            raise
        finally:
            if write_fd is not None:
                os.close(write_fd)  # the script holds the write end now; EOF when it exits
        self.started_at = time.time()
        assert self.proc.stderr is not None and self.proc.stdout is not None
        self._readers = [
            threading.Thread(target=self._copy_stderr, args=(self.proc.stderr,), daemon=True),
            threading.Thread(target=self._copy_stdout, args=(self.proc.stdout,), daemon=True),
        ]
        if read_fd is not None:
            reports = os.fdopen(read_fd, "rb")
            self._readers.append(
                threading.Thread(target=self._read_reports, args=(reports,), daemon=True)
            )
        for t in self._readers:
            t.start()

    def _copy_stdout(self, stream: IO[bytes]) -> None:
        copy_whole_lines(stream, self._write_log)

    def _copy_stderr(self, stream: IO[bytes]) -> None:
        copy_whole_lines(stream, self._write_log, also=self._keep_tail)

    def _write_log(self, data: bytes) -> None:
        with contextlib.suppress(ValueError):  # closed: a grandchild held the pipe
            self._log.write(data)

    def _keep_tail(self, data: bytes) -> None:
        self._tail.append(data)
        self._tail_bytes += len(data)
        while self._tail_bytes - len(self._tail[0]) >= STDERR_TAIL_BYTES:
            self._tail_bytes -= len(self._tail.popleft())

    def _read_reports(self, stream: IO[bytes]) -> None:
        warned = False
        with stream:
            for line in stream:
                if len(line) > MAX_REPORT_LINE or not line.strip():
                    continue
                try:
                    point = parse_report(line, world_size=self.a.world_size)
                except ValueError as exc:
                    if not warned:
                        log.warning("job %s: a report line was not a point: %s", self.a.job_id, exc)
                        warned = True
                    continue
                assert self.send is not None
                if self.last_step is None:
                    self.send(TimelineMark(phase=Phase.FIRST_STEP, at=time.time()))
                self.last_step = point.step
                self.send(point)

    def wait(self) -> ScriptResult:
        """Until the script exits, or is stopped (a STOP/LEAVE control) or released."""
        stopped = aborted = False
        try:
            while self.proc.poll() is None:
                if self.abort.is_set():
                    aborted = True
                    break
                control = self.take_control()
                if control in (Control.STOP, Control.LEAVE):
                    stopped = True
                    break
                # CHECKPOINT: the script saves when it chooses; nothing to ask it.
                time.sleep(POLL_S)
            if stopped or aborted:
                self.terminate()
        finally:
            if self.proc.poll() is None:
                self.terminate()
            else:  # what it started and left behind (data loader workers) goes with it
                self._signal(signal.SIGKILL)
            for t in self._readers:
                t.join(timeout=TERM_GRACE_S)
            self._log.close()
        return ScriptResult(
            returncode=None if stopped or aborted else self.proc.returncode,
            stopped=stopped,
            aborted=aborted,
            last_step=self.last_step,
            stderr_tail=b"".join(self._tail)[-STDERR_TAIL_BYTES:].decode("utf-8", "replace"),
        )

    def terminate(self) -> None:
        """SIGTERM to the script's process group, SIGKILL after TERM_GRACE_S."""
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        # Its children (data loaders...) may outlive it in the group: they go too.
        self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
