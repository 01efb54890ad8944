"""The storage side of a DCP load: DCP's own reader, over shard files verified first.

In `read_data`, each rank

1. maps every shard file its plan reads (read-only; opened without following a link: a
   job's code writes its checkpoint folder, and a link planted there must not make a load
   or an export read elsewhere) and hashes it whole with the manifest's algorithm
   (`elastrain.checkpoints.digest`, XXH3-128 by default), checking its size and digest;
2. agrees with every other rank of the load (one all-gather of verdicts) that all their
   files are intact, before any byte reaches the state: a corrupt file on any rank makes
   every rank raise `CorruptCheckpoint` with its state untouched, and the caller falls
   back to an older checkpoint;
3. runs DCP's own `FileSystemReader.read_data` (one `torch.load(weights_only=True)` per
   record, then a copy into the state) with the verified maps as its file streams: the
   bytes decoded are the bytes hashed, and the disk is read once.

Files not read by any rank's plan are not hashed here; `elastrain.checkpoints.catalog` checks
the small ones (`.metadata`, the rank extras) on rank 0 before the load starts.
"""

from __future__ import annotations

import io
import mmap
import os
import stat
from collections.abc import Generator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from elastrain.checkpoints.digest import new_hasher
from elastrain.checkpoints.integrity import CHUNK_BYTES, CorruptCheckpoint, digest_mismatch
from elastrain.checkpoints.manifest import FileEntry

#: Shard files are opened without following a link (see the module's docstring).
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK  # NONBLOCK: a planted FIFO


class VerifyingReader(FileSystemReader):
    """FileSystemReader that verifies every file its plan reads, on every rank, before
    DCP copies a byte of any into the state.

    `expected`: the manifest's entries (file name -> size, digest, algorithm).
    `process_group`: the group every rank of the load is in (the
    agreement of step 2); None for a load without torch.distributed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        expected: Mapping[str, FileEntry],
        process_group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__(path)
        self.expected = expected
        self.process_group = process_group
        self._verified = _VerifiedFiles()
        self.fs = self._verified

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        names = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        with ExitStack() as maps:
            problem = None
            try:
                for name in names:
                    view = maps.enter_context(_mapped(os.path.join(self.path, name)))
                    problem = self._problem(name, view)
                    if problem is not None:
                        break
                    self._verified.maps[str(self.fs.concat_path(self.path, name))] = view
            except Exception as e:
                # A problem found, not raised: the peers wait for this rank's verdict.
                problem = (
                    f"cannot read {name}: {e}"
                    if isinstance(e, OSError)
                    else f"verification failed: {e!r}"
                )
            try:
                self._agree(problem)
                return super().read_data(plan, planner)
            finally:
                self._verified.maps.clear()

    def _problem(self, name: str, data: memoryview) -> str | None:
        """Why one mapped file is not what the manifest says, or None."""
        entry = self.expected.get(name)
        if entry is None:
            return f"{name} is not in the manifest"
        if len(data) != entry["size"]:
            return f"size mismatch: {name} is {len(data)} bytes, manifest says {entry['size']}"
        hasher = new_hasher(entry["algorithm"])
        for start in range(0, len(data), CHUNK_BYTES):
            hasher.update(data[start : start + CHUNK_BYTES])
        return digest_mismatch(name, entry, hasher.hexdigest())

    def _agree(self, problem: str | None) -> None:
        """Raise CorruptCheckpoint on every rank when any rank found a problem. Every rank
        reaches this (an error reading or hashing a file is a problem found, not an
        exception), so the all-gather always completes, and every rank judges the same
        verdicts."""
        verdicts: list[Any] = [problem]
        me = 0
        if self.process_group is not None:
            verdicts = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(verdicts, problem, group=self.process_group)
            me = dist.get_rank(self.process_group)
        if any(verdict is not None for verdict in verdicts):
            raise CorruptCheckpoint(
                self.path, verdicts[me] or "another rank found one of its shard files corrupt"
            )


class _VerifiedFiles(FileSystem):
    """DCP's file system, whose read streams of shard files are the maps `read_data`
    verified (`maps`: path -> bytes), so DCP decodes exactly the bytes that were hashed.
    Other paths (the `.metadata`, read before any plan) are DCP's own."""

    def __init__(self) -> None:
        self.maps: dict[str, memoryview] = {}

    @contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        view = self.maps.get(str(path))
        if view is None or mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = _BytesView(view)
        try:
            yield stream
        finally:
            stream.close()  # lets go of the map: read_data unmaps it


class _BytesView(io.RawIOBase):
    """A read-only, seekable file over bytes in memory, without copying them (BytesIO
    would copy a whole map): each read copies only what it returns."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data = data
        self._pos = 0

    def close(self) -> None:
        self._data = memoryview(b"")
        super().close()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._data)}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        chunk = self._data[self._pos : self._pos + len(out)]
        out[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._data) if size is None or size < 0 else self._pos + size
        chunk = bytes(self._data[self._pos : end])
        self._pos += len(chunk)
        return chunk


@contextmanager
def _mapped(path: str) -> Generator[memoryview, None, None]:
    """A regular file mapped read-only (an empty one: empty bytes), opened without
    following a link; unmapped on exit."""
    with open(os.open(path, _OPEN_FLAGS), "rb") as f:
        found = os.fstat(f.fileno())
        if not stat.S_ISREG(found.st_mode):
            raise OSError(f"{os.path.basename(path)} is not a regular file")
        if found.st_size == 0:
            yield memoryview(b"")
            return
        m = mmap.mmap(f.fileno(), found.st_size, prot=mmap.PROT_READ)
    m.madvise(mmap.MADV_SEQUENTIAL)  # read ahead generously: hashed in order
    view = memoryview(m)
    try:
        yield view
    finally:
        view.release()
        with suppress(BufferError):  # a view still held keeps it mapped until it goes
            m.close()
