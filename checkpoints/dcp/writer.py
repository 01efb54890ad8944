"""DCP's `FileSystemWriter` with shard files digested while they are written.

Rather than read every shard back (a second pass over all bytes, on one rank), each rank
hashes its shard files' bytes on their way in (`DigestingStream`) and returns the digests
beside its DCP write results, which DCP gathers to the coordinator before `.metadata`:
the coordinator ends holding every shard's digest (`DigestingWriter.shard_digests`).

DCP's shard writer only appends, so the bytes hashed in order are the file's content; a
seek or truncate gives the digest up, and the committer hashes that file from disk
(`describe_files`), as any whose size on disk differs from the bytes hashed. The DCP
internals extended here are pinned by the torch floor and `test_dcp_api_guard.py`.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from elastrain.checkpoints.manifest import DEFAULT_ALGORITHM, FileEntry, new_hasher

# DCP's shard files; `.metadata` and our own files are small and hashed from disk.
SHARD_SUFFIX = ".distcp"
# Marks write results carrying digests: taken out before `.metadata` is written, so the
# metadata is exactly what a plain FileSystemWriter writes.
_DIGEST_FQN_PREFIX = "__elastrain_file_digest__/"


class DigestingStream(io.RawIOBase):
    """A file for writing whose bytes are hashed on their way in; at close,
    `record(size, digest)` when every byte was appended in order (not after a seek or
    truncate)."""

    def __init__(self, path: Path, record: Callable[[int, str], None], algorithm: str) -> None:
        super().__init__()
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._hasher: Any = new_hasher(algorithm)
        self._record = record
        self._size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._hasher is not None:
            self._hasher.update(view)
        self._file.write(view)
        self._size += len(view)
        return len(view)

    def tell(self) -> int:
        return self._file.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if (offset, whence) not in ((self._size, os.SEEK_SET), (0, os.SEEK_END)):
            self._hasher = None
        return self._file.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        self._hasher = None
        return self._file.truncate(size)

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def fileno(self) -> int:
        # DCP fsyncs `stream.fileno()`: what is still in the buffer must be in the file.
        self._file.flush()
        return self._file.fileno()

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._file.close()
        finally:
            super().close()
        if self._hasher is not None:
            self._record(self._size, self._hasher.hexdigest())


class DigestingFileSystem(FileSystem):
    """DCP's local file system, with shard files opened for writing through a digest."""

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM) -> None:
        super().__init__()
        self.algorithm = algorithm
        self._lock = threading.Lock()  # DCP may write several files from several threads
        self._digests: dict[str, FileEntry] = {}

    @contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        path = Path(path)
        if mode != "wb" or not path.name.endswith(SHARD_SUFFIX):
            with super().create_stream(path, mode) as plain:
                yield plain
            return
        name, algorithm = path.name, self.algorithm

        def record(size: int, digest: str) -> None:
            with self._lock:
                self._digests[name] = FileEntry(size=size, digest=digest, algorithm=algorithm)

        with self._lock:
            self._digests.pop(name, None)  # a rewrite must never keep an old digest
        stream = DigestingStream(path, record, algorithm)
        try:
            yield cast(io.IOBase, stream)
        finally:
            stream.close()

    def take_digests(self) -> dict[str, FileEntry]:
        """Digests of the shard files written since the last call, by file name."""
        with self._lock:
            out, self._digests = self._digests, {}
        return out


class DigestingWriter(FileSystemWriter):
    """After a save, on the coordinator, `shard_digests`: shard file name -> entry."""

    def __init__(self, path: str | os.PathLike[str], *, algorithm: str = DEFAULT_ALGORITHM) -> None:
        # sync_files: a file is durable before the manifest names it.
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.fs = self._digesting_fs = DigestingFileSystem(algorithm)
        self.shard_digests: dict[str, FileEntry] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self._digesting_fs.take_digests()
        self.shard_digests = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        with without_zip_crc32():
            results = list(super().write_data(plan, planner).wait())
        results += [
            WriteResult(MetadataIndex(_DIGEST_FQN_PREFIX + name), entry["size"], entry)
            for name, entry in self._digesting_fs.take_digests().items()
        ]
        out: TorchFuture[list[WriteResult]] = TorchFuture()
        out.set_result(results)
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        digests, dcp_results = split_digest_results(results)
        self.shard_digests = digests
        super().finish(metadata, dcp_results)


_crc32_lock = threading.Lock()
_crc32_off_depth = 0  # writes in progress (saves of several checkpointers may overlap)
_crc32_saved = True  # the setting to restore when the last of them ends


@contextmanager
def without_zip_crc32() -> Generator[None, None, None]:
    """torch.save without the zip's per-record crc32 while a shard is written: a third
    of the CPU of a shard write (64 MB fp32: 51 ms with, 36 ms without), on top of the
    manifest's digest, and torch.load never checks it. The flag is process-wide: another
    torch.save meanwhile also skips it, which no torch.load can tell."""
    global _crc32_off_depth, _crc32_saved
    with _crc32_lock:
        if _crc32_off_depth == 0:
            _crc32_saved = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc32_off_depth += 1
    try:
        yield
    finally:
        with _crc32_lock:
            _crc32_off_depth -= 1
            if _crc32_off_depth == 0:
                torch.serialization.set_crc32_options(_crc32_saved)


def split_digest_results(
    results: Sequence[list[WriteResult]],
) -> tuple[dict[str, FileEntry], list[list[WriteResult]]]:
    """(file name -> entry, DCP's own results) from every rank's write results."""
    ours = _DIGEST_FQN_PREFIX
    digests = {
        r.index.fqn.removeprefix(ours): r.storage_data
        for rs in results
        for r in rs
        if r.index.fqn.startswith(ours)
    }
    return digests, [[r for r in rs if not r.index.fqn.startswith(ours)] for rs in results]
