"""What a command job's script imports: `report(step, loss, **metrics)` and `job_dir()`.

A script that runs as a command job (`workload.command`) is started by its rank's worker
process with the environment torchrun gives, plus `ELASTRAIN_JOB_DIR` and, on rank 0,
`ELASTRAIN_REPORT_FD`: the write end of a pipe its worker process reads
(`elastrain.workers.command`). `report` writes one JSON line there per call; the worker sends the
points to the control plane as it does the built-in loop's, and they are charted on the
dashboard. Everywhere else (ranks other than 0, a plain `torchrun`, `python train.py`)
`report` does nothing, so the same script runs unchanged outside elastrain.

This module imports nothing but the standard library: it is loaded into the user's
process, whatever that process has installed.
"""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path

#: The environment variables the worker process sets for the script.
REPORT_FD_ENV = "ELASTRAIN_REPORT_FD"
JOB_DIR_ENV = "ELASTRAIN_JOB_DIR"

_lock = threading.Lock()  # one line at a time from a script's threads
_stream: object = None  # the opened pipe; False once known to be absent or broken


class ReportError(ValueError):
    """`report` was called with something that is not a metric point."""


def report(step: int, loss: float | None = None, **metrics: float | int | None) -> None:
    """Put a point on the job's dashboard: its `loss` and any other numbers by name, at
    optimizer step `step`. Cheap (one short write to a pipe); a no-op outside an elastrain
    command job and on ranks other than 0."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ReportError(f"report: step must be an int >= 0, got {step!r}")
    point: dict[str, float | int | None] = {"step": step, "loss": _number("loss", loss)}
    for name, value in metrics.items():
        point[name] = _number(name, value)
    stream = _open()
    if stream is None:
        return
    line = json.dumps(point, allow_nan=False) + "\n"
    global _stream
    with _lock:
        try:
            stream.write(line)  # type: ignore[attr-defined]
            stream.flush()  # type: ignore[attr-defined]
        except (BrokenPipeError, OSError, ValueError):
            # The worker process is gone (the attempt is ending): training goes on to be
            # stopped with it, not failed by a chart.
            _stream = False


def job_dir() -> Path:
    """The job's folder on the storage every node shares (`ELASTRAIN_JOB_DIR`): where the
    script keeps its own checkpoints, to resume from after a restart at a new world size.
    Outside elastrain: the current directory."""
    return Path(os.environ.get(JOB_DIR_ENV) or ".")


def _number(name: str, value: object) -> float | int | None:
    if value is None:
        return None
    if hasattr(value, "item") and callable(value.item):  # a 0-d tensor or numpy scalar
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReportError(f"report: {name} must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        return None  # a diverged loss: a gap in the chart (JSON has no NaN)
    return value


def _open() -> object:
    global _stream
    if _stream is None:
        with _lock:
            if _stream is None:
                fd = os.environ.get(REPORT_FD_ENV)
                try:
                    _stream = open(int(fd), "w", encoding="utf-8", closefd=False) if fd else False  # noqa: SIM115
                except (ValueError, OSError):
                    _stream = False
    return _stream or None
