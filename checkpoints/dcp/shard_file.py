"""A shard file written once, in order, hashed on the way, with direct I/O where it can.

Writing a new file through the page cache costs this VM's CPU ~2.4 ms per MB (copying
into freshly allocated cache pages, ext4's delayed allocation, the dirty-page
accounting): ~0.47 s of a core for a 192 MB shard. Direct I/O (`O_DIRECT`) from a
page-aligned buffer hands the pages to the disk instead: 0.006 s for the same shard,
and less wall time too (docs/bench-checkpoint.md, "fourth round"). On two cores busy
training, that CPU is what an async save takes from training.

Direct I/O wants the file offset, the length and the memory address of every write
aligned to the disk's logical block (`BLOCK` covers 512 and 4096). So:

- large data that starts at an aligned file offset and lies at an aligned address (the
  async save's staged copies, `staging.AlignedStateDictStager`) goes to the disk as it is;
- everything else (zip headers, small records, a tail shorter than a block, data at an
  unaligned address such as a synchronous save's live tensors) is gathered in a
  page-aligned bounce buffer and written from there in whole blocks;
- the last, partial block is written padded and the file truncated to its true size.

Where the file system refuses `O_DIRECT` (tmpfs, some FUSE mounts; seen at open or at
the first write) or `ELASTRAIN_CHECKPOINT_DIRECT_IO=0` turns it off, the same writes go
through the page cache, with the disk's writeback started every
`WRITEBACK_EVERY_BYTES`. Durability comes from the fsync that closes every shard in
either mode (direct I/O does not flush the disk's cache).

`aligned_record_start` places a large tensor record so that its data starts at a block
boundary: at most `BLOCK - 1` zero bytes between records, which no reader sees (DCP
reads each record by its offset and length).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from elastrain.checkpoints.digest import DEFAULT_ALGORITHM, new_hasher

# The alignment direct I/O needs for offsets, lengths and addresses: the largest logical
# block size of common disks (4096 also satisfies 512), and the page size.
BLOCK = 4096
# Small writes are gathered here and written in whole blocks.
BOUNCE_BYTES = 8 * 1024 * 1024
# A tensor record whose data is at least this big starts its data at a block boundary.
# The padding before it (< BLOCK) is then at most 0.4 % of the record.
ALIGN_RECORD_MIN_BYTES = 1024 * 1024
# Page-cache mode: start the disk writeback every this many bytes (Linux), so the disk
# works while the next tensors are written and the closing fsync finds little left.
WRITEBACK_EVERY_BYTES = 32 * 1024 * 1024
DIRECT_IO_ENV = "ELASTRAIN_CHECKPOINT_DIRECT_IO"


def direct_io_wanted() -> bool:
    """Whether shard files try direct I/O: on Linux unless the environment turns it off
    (e.g. on NFS, where each direct write is a synchronous round trip)."""
    return hasattr(os, "O_DIRECT") and os.environ.get(DIRECT_IO_ENV, "1") != "0"


def aligned_record_start(end: int, prefix_bytes: int, data_bytes: int) -> int:
    """Where a record (`prefix_bytes` of header, then `data_bytes` of data) goes in a file
    whose content so far ends at `end`: right there, or, for large data, at the nearest
    offset from which its data starts at a block boundary."""
    if data_bytes < ALIGN_RECORD_MIN_BYTES:
        return end
    data_start = -(-(end + prefix_bytes) // BLOCK) * BLOCK
    return data_start - prefix_bytes


def is_aligned(view: memoryview) -> bool:
    """Whether `view`'s first byte lies at a block boundary in memory."""
    if len(view) == 0:
        return True
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    return int(address) % BLOCK == 0


def as_bytes(data: Any) -> memoryview:
    """`data` as a flat view of bytes (a contiguous copy when it is not contiguous)."""
    try:
        return memoryview(data).cast("B")
    except TypeError:
        return memoryview(bytes(memoryview(data)))


class DigestingStream:
    """A binary file written in order that hashes every byte written through it.

    Offers what DCP's shard writer and torch.save use (write, tell, flush, fileno,
    close). seek/truncate would break "digest == content": they void the digest (the
    committer then hashes the file from disk) and the rest goes through the page cache.
    `on_close(size, digest)` is called at close when the digest is that of the file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_close: Callable[[int, str], None],
        algorithm: str = DEFAULT_ALGORITHM,
        *,
        direct: bool | None = None,
    ) -> None:
        self.name = str(path)
        self._on_close = on_close
        self._hash = new_hasher(algorithm)
        self._valid = True
        self._closed = False
        self.direct = direct_io_wanted() if direct is None else direct
        self._fd = self._open(truncate=True)
        self._bounce = mmap.mmap(-1, BOUNCE_BYTES)  # page-aligned
        self._bounce_view = memoryview(self._bounce)
        self._base = 0  # file offset of the bounce buffer's first byte (direct: aligned)
        self._fill = 0  # bytes in the bounce buffer
        self._end = 0  # the file's logical size
        self._written_back_to = 0
        self._written_out = True  # the file holds everything written (the padded tail too)

    def _open(self, *, truncate: bool) -> int:
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0)
        if self.direct:
            try:
                return os.open(self.name, flags | os.O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False  # this file system refuses direct I/O
        return os.open(self.name, flags, 0o644)

    # -- writing ----------------------------------------------------------------------

    def write(self, data: Any) -> int:
        if self._closed:
            raise ValueError("write to a closed shard file")
        view = as_bytes(data)
        size = len(view)
        self._written_out = False
        self._hash.update(view)  # releases the GIL on large buffers
        position = self._base + self._fill
        if size >= BLOCK and (not self.direct or (position % BLOCK == 0 and is_aligned(view))):
            # Straight from the caller's memory: all of it through the page cache, the
            # whole blocks of it with direct I/O (the tail joins the bounce buffer).
            self._drain()
            body = size - size % BLOCK if self.direct else size
            self._pwrite(view[:body], self._base)
            self._base += body
            view = view[body:]
        self._gather(view)
        self._end = max(self._end, self._base + self._fill)
        self._start_writeback()
        return size

    def _gather(self, view: memoryview) -> None:
        while len(view):
            take = min(len(view), BOUNCE_BYTES - self._fill)
            self._bounce_view[self._fill : self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == BOUNCE_BYTES:
                self._drain()

    def _drain(self) -> None:
        """Write the bounce buffer out and empty it. With direct I/O only at a block
        boundary (every caller: a full buffer, or before an aligned write)."""
        if self._fill:
            self._pwrite(self._bounce_view[: self._fill], self._base)
            self._base += self._fill
            self._fill = 0

    def _pwrite(self, view: memoryview, offset: int) -> None:
        while len(view):
            try:
                written = os.pwrite(self._fd, view, offset)
            except OSError as e:
                # Accepted at open, refused at the write (some FUSE file systems): the
                # same bytes through the page cache.
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                self._leave_direct_io()
                continue
            view = view[written:]
            offset += written

    def _leave_direct_io(self) -> None:
        os.close(self._fd)
        self.direct = False
        self._fd = self._open(truncate=False)

    def _start_writeback(self) -> None:
        if self.direct or self._base - self._written_back_to < WRITEBACK_EVERY_BYTES:
            return
        start_writeback(self._fd, self._written_back_to, self._base - self._written_back_to)
        self._written_back_to = self._base

    def flush(self) -> None:
        """Hand the gathered bytes to the file: through the page cache, as a buffered file
        does. With direct I/O they wait for a whole block (torch.save flushes after every
        tensor: hundreds of small synchronous writes a shard); `fileno()` and `close()`
        put everything in the file."""
        if not self._closed and not self.direct:
            self._drain()

    def _write_out(self) -> None:
        """Everything written so far is in the file (not yet durable: that is the fsync)."""
        if not self.direct:
            self._drain()
            return
        if self._written_out:  # e.g. close() after DCP's fsync of fileno(): no second write
            return
        whole = self._fill - self._fill % BLOCK
        if whole:
            self._pwrite(self._bounce_view[:whole], self._base)
            tail = bytes(self._bounce_view[whole : self._fill])  # < BLOCK
            self._bounce_view[: len(tail)] = tail
            self._base += whole
            self._fill = len(tail)
        if self._fill:
            # The partial last block goes out padded with zeros and the file is cut to
            # its true size; it stays in the bounce buffer so later writes complete it.
            padded = -(-self._fill // BLOCK) * BLOCK
            self._bounce_view[self._fill : padded] = bytes(padded - self._fill)
            self._pwrite(self._bounce_view[:padded], self._base)
            os.ftruncate(self._fd, self._end)
        self._written_out = True

    def tell(self) -> int:
        return self._base + self._fill

    def fileno(self) -> int:
        # DCP's own shard writer fsyncs `fileno()` without a flush first: what is still
        # in the bounce buffer must be in the file by then, or the fsync would not cover it.
        self._write_out()
        return self._fd

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._go_plain()
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._base, os.SEEK_END: self._end}[whence]
        self._base = base + offset
        return self._base

    def truncate(self, size: int | None = None) -> int:
        self._go_plain()
        size = self._base if size is None else size
        os.ftruncate(self._fd, size)
        self._end = size
        return size

    def _go_plain(self) -> None:
        """After a seek or truncate the content is no longer the hashed sequence: no
        digest, and no direct I/O (writes may then land anywhere)."""
        self._valid = False
        position = self.tell()
        self._write_out()
        self._base, self._fill = position, 0
        if self.direct:
            self._leave_direct_io()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._write_out()
        finally:
            self._closed = True
            os.close(self._fd)
            self._bounce_view.release()
            self._bounce.close()
        if self._valid and self._end == _size_on_disk(self.name):
            self._on_close(self._end, self._hash.hexdigest())

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> DigestingStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _size_on_disk(path: str) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return -1


def _load_sync_file_range() -> Any:
    """libc's sync_file_range (Linux; Python's os module does not offer it), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing a file range to disk without waiting. Best effort: durability comes
    from the fsync that closes every shard, so a failure here is ignored."""
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
