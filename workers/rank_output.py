"""Everything a rank says goes to its log file: elastrain's own log records and, in a
process of the runtime, every line the process writes to stdout or stderr (a factory's
`print`, a dataset's progress bar, `warnings`, tracebacks, a native library's output),
as `elastrain logs`, its `-f` and the dashboard read them.

Ray sends a worker's stdout and stderr to files of its own session, which nobody reading a
job's logs sees. So while a rank runs an attempt, its process's fds 1 and 2 are one pipe
(`captured_output`): a thread reads it and writes each line through the rank's log
handler, tagged `[rank R] INFO output:` after the time, in the order the process wrote
them, and copies it to the fd it replaced, so Ray's own files and a driver that shows
worker output still get it. The handler is capped (`workers/log_cap.py`): past
`RANK_LOG_BYTES` one note says the rest is dropped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from elastrain.workers.log_cap import RANK_LOG_BYTES, CappedFileHandler

#: The logger whose records go to a rank's file (the loop's, strategies', process's).
WORKERS_LOGGER = "elastrain.workers"
#: A line longer than this is written in pieces (a progress bar redrawn with `\r`, binary).
MAX_LINE = 64 * 1024
#: How long the end of an attempt waits for output still in the pipe.
_DRAIN_S = 2.0


@contextlib.contextmanager
def rank_log(
    path: Path | None, rank: int, limit: int = RANK_LOG_BYTES
) -> Iterator[CappedFileHandler | None]:
    """elastrain's log records, while inside, in the rank's file `path` (capped); the
    handler already there when an outer `rank_log` of the same file is open."""
    if path is None:
        yield None
        return
    logger = logging.getLogger(WORKERS_LOGGER)
    for handler in logger.handlers:
        if isinstance(handler, CappedFileHandler) and handler.baseFilename == str(path.absolute()):
            yield handler
            return
    handler = CappedFileHandler(path, limit)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    )
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        handler.close()


@contextlib.contextmanager
def captured_output(path: Path, rank: int, limit: int = RANK_LOG_BYTES) -> Iterator[None]:
    """While inside, every line this process writes to fd 1 or 2 (and elastrain's log
    records) lands in the rank's log file `path`. For a process that runs one rank at a
    time: the fds are the process's."""
    with rank_log(path, rank, limit) as handler:
        assert handler is not None
        pump = _Pump(handler)
        pump.start()
        try:
            yield
        finally:
            pump.stop()


class _Pump:
    """fds 1 and 2 as one pipe, read by a thread that writes lines to `handler`."""

    def __init__(self, handler: logging.Handler) -> None:
        self.handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastrain-output", daemon=True)
        self._read = self._saved_out = self._saved_err = -1
        self._line_buffering: bool | None = getattr(sys.stdout, "line_buffering", None)

    def start(self) -> None:
        _flush_python_streams()
        self._saved_out, self._saved_err = os.dup(1), os.dup(2)
        self._read, write = os.pipe()
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)
        # A print shows as it is made, not when a block of them fills Python's buffer.
        with contextlib.suppress(AttributeError, ValueError):
            sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        self._thread.start()

    def stop(self) -> None:
        _flush_python_streams()
        with contextlib.suppress(AttributeError, ValueError):
            if self._line_buffering is not None:
                sys.stdout.reconfigure(line_buffering=self._line_buffering)  # type: ignore[union-attr]
        # The pipe's last writers here are fds 1 and 2: put them back, and the thread reads
        # to the end (a child process that still holds the pipe is not waited for long).
        os.dup2(self._saved_out, 1)
        os.dup2(self._saved_err, 2)
        self._stop.set()
        self._thread.join(_DRAIN_S + 1.0)
        if self._thread.is_alive():
            return  # (cannot be: it ends by its deadline) its fds stay open, never reused
        for fd in (self._saved_out, self._saved_err, self._read):
            os.close(fd)

    def _run(self) -> None:
        pending = b""
        deadline: float | None = None  # once stopped: how long output still in flight may take
        while deadline is None or time.monotonic() < deadline:
            if deadline is None and self._stop.is_set():
                deadline = time.monotonic() + _DRAIN_S
            ready, _, _ = select.select([self._read], [], [], 0.1)
            if not ready:
                if deadline is not None:
                    break  # stopped, and nothing more came
                continue
            chunk = os.read(self._read, 65536)
            if not chunk:  # every writer closed it
                break
            with contextlib.suppress(OSError):
                os.write(self._saved_out, chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            while len(pending) > MAX_LINE:
                lines.append(pending[:MAX_LINE])
                pending = pending[MAX_LINE:]
            for line in lines:
                self._emit(line)
        if pending:
            self._emit(pending)

    def _emit(self, line: bytes) -> None:
        text = line.rstrip(b"\r").decode("utf-8", "replace")
        record = logging.LogRecord("output", logging.INFO, "", 0, text, None, None)
        # Never raise nor print from here: this thread is the one that reads stderr.
        with contextlib.suppress(Exception):
            self.handler.handle(record)


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
