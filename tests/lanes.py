"""`make test` after set-up: lint, the suite and every bench's quick mode in three lanes at
once, so CI stays in its budget on 2 cores.

    .venv/bin/python -m tests.lanes [pytest args...]

Lane `ray` runs the tests marked `ray` (they start Ray clusters), one after another as a
plain `pytest -m ray` would: two of these at once on 2 cores would race each other's
health checks and timeouts, and the chaos tests' network namespaces have fixed names.
Lane `rest` runs the other tests (unit, API, browser, contract) and the Ray tests marked
`beside` (each on a local Ray of its own, asserting no timing), mostly while the Ray
tests wait on Ray, then `bench/all.py --quick` (checks that every bench script still runs;
its figures are not the point there). Everything in it that starts Ray does so under a Ray
temp dir of its own, so an address-less `ray.init()` cannot find the Ray lane's cluster.
Lane `lint` runs ruff and mypy (about two minutes of one core, cold), beside the others
rather than before them.

Each command's output goes to a file and is printed whole when it ends; the exit status
is the first failing command's. After the last, each failing command's digest is printed
again (`failure_digest`: the failed tests and their error lines), so the end of a CI log,
often all a reader gets to see, says what failed and why. (pytest-xdist's `--dist
loadgroup` could split the suite the same way, but it stopped grouping on pytest 9.2:
pytest-dev/pytest-xdist#1386.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PYTEST_NO_TESTS = 5  # pytest's status when a selection matches nothing: not a failure
DIGEST_LINES_PER_FAILURE = 12
DIGEST_LINE_CHARS = 800  # a wait_for's message carries the job's whole event list
#: pytest's `path.py:123: ErrorType` (or `: in function`) line in a failure's traceback.
_FAILURE_PLACE = re.compile(r"^\S+\.py:\d+: \S")


@dataclass(frozen=True)
class Command:
    argv: list[str]
    ok: frozenset[int] = frozenset({0})  # exit statuses that are not a failure


def pytest_command(*args: str) -> Command:
    return Command([sys.executable, "-m", "pytest", *args], frozenset({0, PYTEST_NO_TESTS}))


@dataclass
class Lane:
    name: str
    commands: list[Command]
    env: dict[str, str]
    current: Command = Command([])
    started: float = 0.0
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    status: int = 0
    digests: list[str] = field(default_factory=list)  # of its failed commands


def lanes(pytest_args: list[str], tmp: Path) -> list[Lane]:
    bin_dir = Path(sys.executable).parent
    own_ray = tmp / "ray"  # short: Ray's socket paths must fit in 107 bytes
    own_ray.mkdir()
    return [
        Lane("ray", [pytest_command("-m", "ray and not beside", *pytest_args)], dict(os.environ)),
        Lane(
            "rest",
            [
                pytest_command("-m", "not ray or beside", *pytest_args),
                Command([sys.executable, "bench/all.py", "--quick"]),
            ],
            {**os.environ, "RAY_TMPDIR": str(own_ray)},
        ),
        Lane(
            "lint",
            [
                Command([str(bin_dir / "ruff"), "check", "."]),
                Command([str(bin_dir / "ruff"), "format", "--check", "."]),
                Command([str(bin_dir / "mypy")]),
            ],
            dict(os.environ),
        ),
    ]


def advance(lane: Lane, tmp: Path) -> bool:
    """Start the lane's next command if the current one ended; False once it is done."""
    if lane.proc is not None:
        code = lane.proc.poll()
        if code is None:
            return True
        assert lane.log is not None
        print(f"== {lane.name}: exit {code} after {time.monotonic() - lane.started:.0f} s")
        output = lane.log.read_text(errors="replace")
        sys.stdout.write(output)
        sys.stdout.flush()
        if code not in lane.current.ok:
            lane.status = lane.status or code
            name = " ".join([Path(lane.current.argv[0]).name, *lane.current.argv[1:]])
            lane.digests.append(f"-- {lane.name}: {name}: exit {code}\n{failure_digest(output)}")
        lane.proc = None
    if not lane.commands:
        return False
    lane.current = lane.commands.pop(0)
    argv = lane.current.argv
    lane.log = tmp / f"{lane.name}-{len(lane.commands)}.log"
    print(f"== {lane.name}: {' '.join([Path(argv[0]).name, *argv[1:]])}", flush=True)
    lane.started = time.monotonic()
    with open(lane.log, "wb") as out:
        lane.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=lane.env)
    return True


def run(active: list[Lane], tmp: Path) -> int:
    """Run the lanes side by side; the first failing command's exit status, else 0."""
    everyone = list(active)
    while active:
        active = [lane for lane in active if advance(lane, tmp)]
        time.sleep(0.2)
    digests = [digest for lane in everyone for digest in lane.digests]
    if digests:
        print("== what failed (repeated from above)", *digests, sep="\n", flush=True)
    return next((lane.status for lane in everyone if lane.status), 0)


def failure_digest(output: str) -> str:
    """What a failed command's output says went wrong, in a few lines: for pytest, each
    failed test's heading, its `E` lines and the place it failed (the first
    `DIGEST_LINES_PER_FAILURE` lines, each cut at `DIGEST_LINE_CHARS`), then the short
    summary; for anything else, its last lines."""
    lines = output.splitlines()
    kept: list[str] = []
    left = 0  # lines the current failure may still add
    section = ""
    for line in lines:
        if line.startswith("=") and line.endswith("=") and line.strip("= "):
            section, left = line.strip("= "), 0
            if section == "short test summary info":
                kept.append(line)
        elif section == "short test summary info":
            kept.append(line)
        elif section in ("FAILURES", "ERRORS"):
            if line.startswith("_") and line.endswith("_"):
                kept.append(line)  # a failed test's heading
                left = DIGEST_LINES_PER_FAILURE
            elif left and (line.startswith("E ") or _FAILURE_PLACE.match(line)):
                kept.append(line)
                left -= 1
    if not kept:
        kept = lines[-DIGEST_LINES_PER_FAILURE:]
    return "\n".join(_cut(line) for line in kept)


def _cut(line: str) -> str:
    return line if len(line) <= DIGEST_LINE_CHARS else line[:DIGEST_LINE_CHARS] + " [...]"


def main(pytest_args: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="lanes-") as name:
        return run(lanes(pytest_args, Path(name)), Path(name))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
