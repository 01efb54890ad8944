"""A rank's log file stops growing at `RANK_LOG_BYTES` (issue 45, item 5).

A runaway loop that logs every step, or a job's code printing in a tight loop, would
otherwise fill the shared storage the whole cluster's checkpoints live on. Past the cap
one note says so, and the rest is dropped: the start of a log (the configuration, the
first errors) is what a reader needs most, and the end of a failed rank's output reaches
the job's failure reason through its own tail (`workers/command.py`).

This bounds what the workers write on their own; a job's code can still write any file
in its logs folder itself, which is why the API reads only a bounded part of that folder
(`elastrain.api.logs`, `Settings.log_files_per_job` and `log_bytes_per_response`).

`LogBudget` is the pure decision (how much of a write fits); `CappedFileHandler` (a
`logging` handler, the training loop's) and `CappedWriter` (bytes, for a copy of a
subprocess's output) carry it out.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

#: The most bytes the workers write to one attempt-rank log file: far past what a
#: rank that logs a line per step writes in a long run (a million steps of 60-byte lines).
RANK_LOG_BYTES = 64 * 1024 * 1024


def truncation_note(limit: int) -> bytes:
    return (
        f"\n[elastrain] this rank's log reached {limit} bytes, the most the workers write "
        "to one file: what follows is dropped\n"
    ).encode()


@dataclass(slots=True)
class LogBudget:
    """How many bytes of a file's `limit` are written (`used`), and whether the note that
    it is full was written."""

    limit: int
    used: int = 0
    noted: bool = False

    def take(self, size: int) -> tuple[int, bool]:
        """Of a write of `size` bytes: how many to write (a prefix), and whether to write
        the note after them (once, the first time a write does not fit)."""
        if self.noted:
            return 0, False
        room = max(0, self.limit - self.used)
        if size <= room:
            self.used += size
            return size, False
        self.used += room
        self.noted = True
        return room, True


def _budget_of(fd: int, limit: int) -> LogBudget:
    # A file that already holds bytes (an earlier writer of the same rank) counts them.
    used = os.fstat(fd).st_size
    return LogBudget(limit=limit, used=min(used, limit), noted=used >= limit)


class CappedWriter:
    """Appends bytes to `path` until `limit`, then one note, then nothing. Thread-safe
    (a subprocess's stdout and stderr may be copied by two threads)."""

    def __init__(self, path: Path, limit: int = RANK_LOG_BYTES) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        self._fd = os.open(path, flags, 0o644)
        self._budget = _budget_of(self._fd, limit)
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._fd < 0:
                return
            size, note = self._budget.take(len(data))
            if size:
                os.write(self._fd, data[:size])
            if note:
                os.write(self._fd, truncation_note(self._budget.limit))

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class CappedFileHandler(logging.FileHandler):
    """A `logging.FileHandler` whose file stops at `limit` bytes, with one note, and that
    never writes through a link (a job's code can plant one at the name it will open)."""

    def __init__(self, path: Path, limit: int = RANK_LOG_BYTES) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(path, encoding="utf-8")
        assert self.stream is not None
        self._budget = _budget_of(self.stream.fileno(), limit)

    def _open(self) -> io.TextIOWrapper:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(self.baseFilename, flags, 0o644)
        return open(fd, "a", encoding=self.encoding, errors=self.errors)

    def emit(self, record: logging.LogRecord) -> None:
        # `Handler.handle` holds the handler's lock around this.
        try:
            line = (self.format(record) + self.terminator).encode("utf-8", "replace")
        except Exception:
            self.handleError(record)
            return
        size, note = self._budget.take(len(line))
        stream = self.stream
        if stream is None or (not size and not note):
            return
        text = line[:size].decode("utf-8", "ignore")
        if note:
            text += truncation_note(self._budget.limit).decode()
        stream.write(text)
        stream.flush()
