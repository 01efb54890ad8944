"""Make a process slower from outside, as a slower device would: stop it and resume it in
turns (as `cpulimit` does), `stopped` of every `period_s` stopped.

Run as its own process (`python -m tests.chaos.slow_down PID PERIOD_S STOPPED`) at a
real-time priority where the user may set one (root): the turns are a few milliseconds,
and a thread of a busy Python process (the bench's, the test's) overslept them under
load, so the campaign's "2x slow" rank was sometimes barely slower and never found slow.
On SIGTERM it resumes the process and prints the share of the time it held it stopped,
which is the slowdown it achieved: 1 / (1 - share).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time


def _real_time() -> None:
    """Wake on time: SCHED_FIFO at the lowest real-time priority (a loop that sleeps
    nearly all of the time, so it never starves the machine)."""
    with contextlib.suppress(PermissionError, AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))


def run(pid: int, period_s: float, stopped: float) -> float:
    """Stop and resume `pid` until SIGTERM; the share of the time it was stopped."""
    done = False

    def finish(*_: object) -> None:
        nonlocal done
        done = True

    signal.signal(signal.SIGTERM, finish)
    _real_time()
    stop_s, run_s = period_s * stopped, period_s * (1 - stopped)
    held = 0.0
    started = time.monotonic()
    try:
        while not done:
            at = time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
            held += time.monotonic() - at
            time.sleep(run_s)
    except ProcessLookupError:
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return held / max(time.monotonic() - started, 1e-9)


if __name__ == "__main__":
    share = run(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))
    print(json.dumps({"stopped_share": share}), flush=True)
