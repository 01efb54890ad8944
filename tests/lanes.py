"""`make test` after lint: the suite and every bench's quick mode in two lanes at once, so
CI stays in its budget on 2 cores.

    .venv/bin/python -m tests.lanes [pytest args...]

Lane `ray` runs every test marked `ray` (they start Ray clusters), one after another as a
plain `pytest -m ray` would: two of these at once on 2 cores would race each other's
health checks and timeouts, and the chaos tests' network namespaces have fixed names.
Lane `rest` runs the other tests (unit, API, browser, contract), mostly while the Ray
tests wait on Ray, then `bench/all.py --quick` (checks that every bench script still runs;
its figures are not the point there). The benches that start Ray do so under a Ray temp
dir of their own, so an address-less `ray.init()` cannot find the tests' cluster.

Each command's output goes to a file and is printed whole when it ends; the exit status
is the first failing command's. (pytest-xdist's `--dist loadgroup` could split the suite
the same way, but it stopped grouping on pytest 9.2: pytest-dev/pytest-xdist#1386.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PYTEST_NO_TESTS = 5  # a selection that matches nothing is not a failure


@dataclass
class Lane:
    name: str
    commands: list[list[str]]
    env: dict[str, str]
    started: float = 0.0
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    status: int = 0


def lanes(pytest_args: list[str], tmp: Path) -> list[Lane]:
    py = sys.executable
    bench_ray = tmp / "ray"  # short: Ray's socket paths must fit in 107 bytes
    bench_ray.mkdir()
    return [
        Lane("ray", [[py, "-m", "pytest", "-m", "ray", *pytest_args]], dict(os.environ)),
        Lane(
            "rest",
            [[py, "-m", "pytest", "-m", "not ray", *pytest_args], [py, "bench/all.py", "--quick"]],
            {**os.environ, "RAY_TMPDIR": str(bench_ray)},
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
        sys.stdout.write(lane.log.read_text(errors="replace"))
        sys.stdout.flush()
        if code not in (0, PYTEST_NO_TESTS) and lane.status == 0:
            lane.status = code
        lane.proc = None
    if not lane.commands:
        return False
    argv = lane.commands.pop(0)
    lane.log = tmp / f"{lane.name}-{len(lane.commands)}.log"
    print(f"== {lane.name}: {' '.join(argv[1:])}", flush=True)
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
    return next((lane.status for lane in everyone if lane.status), 0)


def main(pytest_args: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="lanes-") as name:
        return run(lanes(pytest_args, Path(name)), Path(name))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
