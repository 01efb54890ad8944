"""How a test waits: on the condition it needs, until a deadline, failing with what never
happened. Never a fixed sleep standing in for "long enough": on a loaded CI machine it is
too short, everywhere else it is time lost.

    wait_until(lambda: job_state() == "RUNNING", 60, "the job runs")
    pid = wait_until(find_pid, 30, "the worker started")   # returns the condition's value
    wait_until(lambda: exited(pid), 30, f"{pid} exited")
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T],
    timeout: float,
    what: str,
    *,
    poll_s: float = 0.1,
    detail: Callable[[], object] | None = None,
) -> T:
    """Call `condition` every `poll_s` until it returns something true, and return that.
    After `timeout` seconds: AssertionError naming `what` (and `detail()`, e.g. a log's
    tail, to say why)."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            why = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"not reached in {timeout:g} s: {what}{why}")
        time.sleep(poll_s)


def exited(pid: int) -> bool:
    """The process is gone, or a zombie its parent has not reaped yet (it runs no more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"  # the state follows "(command name)"
