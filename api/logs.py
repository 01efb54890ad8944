"""Reading worker log files for `GET /v1/jobs/{id}/logs`, resumably.

Workers write `*.log` files under `<storage>/jobs/<id>/logs/` (one per rank, possibly in a
folder per attempt). The attempt a file belongs to is the number after `attempt` in its
relative path (`attempt-003-rank-0.log`, as the workers name them, or `attempt_3/rank0.log`); files without one count as
attempt 0. Several files of one attempt grow at once, so a single byte offset cannot
say how far a client has read: the cursor holds one position per file. For the common
single-file case it is just the byte offset, so `?offset=1234` works as one would expect.
A cursor belongs to one attempt: a follower pins `attempt` and moves on, from offset 0,
when `latest_attempt` says a newer one has started.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from elastrain.contracts.storage import attempt_of_log

#: The most bytes one call returns; a follower gets the rest on its next call.
MAX_CHUNK = 1 << 20
#: Positions in a cursor beyond this are nonsense (and would overflow a seek).
MAX_POSITION = 2**62
#: The most log files of a job one call looks at (`Settings.log_files_per_job`), and how
#: many folder entries it may walk to find them: a job's code can fill its logs folder
#: with 40,000 files, and one call must stay small and quick whatever it put there.
MAX_FILES = 256
_ENTRIES_PER_FILE = 256
#: The workers' own file names, listed before any other (`contracts.storage.log_file_name`).
_RANK_LOG = re.compile(r"attempt-\d+-rank-\d+\.log")


class BadCursor(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Chunk:
    text: str
    next_offset: str
    attempt: int | None
    latest_attempt: int | None
    files: list[str]


def _decode_cursor(offset: str, names: list[str]) -> dict[str, int]:
    offset = offset.strip()
    if offset in ("", "0"):
        return {}
    if offset.isascii() and offset.isdigit():  # "²".isdigit() is True, and int() refuses it
        # A plain byte offset: the first (usually only) file.
        return {names[0]: min(int(offset), MAX_POSITION)} if names else {}
    try:
        raw = json.loads(
            base64.urlsafe_b64decode(offset.encode("ascii") + b"=" * (-len(offset) % 4))
        )
        if not isinstance(raw, dict) or not all(
            isinstance(k, str) and type(v) is int and 0 <= v <= MAX_POSITION for k, v in raw.items()
        ):
            raise ValueError
    except ValueError as exc:  # binascii.Error and JSONDecodeError are ValueErrors
        raise BadCursor(
            "offset: pass 0, a byte offset, or the next_offset of an earlier response"
        ) from exc
    return raw


def _encode_cursor(positions: dict[str, int]) -> str:
    if len(positions) <= 1:
        return str(next(iter(positions.values()), 0))
    raw = json.dumps(positions, separators=(",", ":"), sort_keys=True).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _log_files(directory: Path, max_files: int = MAX_FILES) -> tuple[list[str], bool]:
    """`*.log` regular files under `directory`, relative to it: the workers' own files
    first, at most `max_files`; and whether any were left out. Names are gathered in a
    walk of at most `_ENTRIES_PER_FILE` entries a file (names cost little), and only the
    chosen ones are looked at. Symbolic links are never followed, to a file or a folder:
    a job's code writes this folder, and a link in it to the API's database or another
    job's files must not make the API serve them."""
    if not directory.is_dir() or directory.resolve() != directory.absolute():
        return [], False  # missing, or a link somewhere on the way (the root is resolved)
    budget = max_files * _ENTRIES_PER_FILE
    names: list[str] = []
    more = False
    for root, dirs, files in os.walk(directory, followlinks=False):
        base = Path(root)
        dirs[:] = [d for d in dirs if not (base / d).is_symlink()]
        budget -= len(dirs) + len(files)
        rel = base.relative_to(directory)
        names += [(rel / name).as_posix() for name in files if name.endswith(".log")]
        if budget < 0:
            more = True
            break
    names.sort(key=_rank_logs_first)
    found: list[str] = []
    for name in names:
        if len(found) == max_files:
            return found, True
        with contextlib.suppress(OSError):
            if stat.S_ISREG((directory / name).lstat().st_mode):
                found.append(name)
    return found, more


def _rank_logs_first(name: str) -> tuple[bool, str]:
    return (_RANK_LOG.fullmatch(name) is None, name)


def _read_from(path: Path, start: int, budget: int) -> bytes:
    # O_NOFOLLOW: a file swapped for a link between the listing and here is refused too;
    # O_NONBLOCK: one swapped for a FIFO does not hold the request until a writer comes.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags)
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""  # a FIFO or a device put here since the listing: nothing to read
        fh.seek(start)
        data = fh.read(budget)
    if len(data) == budget:
        # Stop at a line end so that a line (or a UTF-8 sequence) is never cut in two,
        # unless a single line is longer than the whole budget.
        cut = data.rfind(b"\n")
        if cut >= 0:
            data = data[: cut + 1]
    return data


def read_logs(
    directory: Path,
    *,
    offset: str = "0",
    attempt: int | None = None,
    max_bytes: int = MAX_CHUNK,
    max_files: int = MAX_FILES,
) -> Chunk:
    """New text of one attempt's logs since `offset` (the newest attempt by default), at
    most `max_bytes` of it, from at most `max_files` files (the first call says, in a
    line of its own, when there were more)."""
    by_attempt: dict[int, list[str]] = {}
    listed, more = _log_files(directory, max_files)
    for rel in listed:
        by_attempt.setdefault(attempt_of_log(rel), []).append(rel)
    latest = max(by_attempt) if by_attempt else None
    if attempt is None:
        attempt = latest
    names = sorted(by_attempt.get(attempt, []), key=_rank_logs_first) if attempt is not None else []
    positions = _decode_cursor(offset, names)

    parts: list[str] = []
    budget = max_bytes
    if more and not positions:
        note = (
            f"[elastrain] this job's logs folder holds more than {max_files} log files "
            "(ELASTRAIN_LOG_FILES_PER_JOB): only the first are read\n"
        )
        parts.append(note)
        budget -= len(note)
    for name in names:
        path = directory / name
        start = positions.get(name, 0)
        try:
            size = path.lstat().st_size
            if start > size:  # the file was truncated or replaced: read it again from the top
                start = 0
            data = _read_from(path, start, budget) if budget > 0 and size > start else b""
        except OSError:  # removed, or swapped for a link, since the listing
            data = b""
        positions[name] = start + len(data)
        budget -= len(data)
        if not data:
            continue
        text = data.decode("utf-8", errors="replace")
        if len(names) > 1:
            # Tell the ranks apart, like `ray logs` / torchrun's `[rank]:` prefixes.
            tag = Path(name).stem
            text = "".join(f"[{tag}] {line}" for line in text.splitlines(keepends=True))
            budget -= len(text) - len(data)  # the tags count too (roughly: by characters)
        parts.append(text)
    # Keep only the files of this attempt in the cursor, in a stable order.
    cursor = {name: positions.get(name, 0) for name in names}
    return Chunk(
        text="".join(parts),
        next_offset=_encode_cursor(cursor),
        attempt=attempt,
        latest_attempt=latest,
        files=names,
    )
