"""The storage side of a DCP save: shard files digested while they are written.

The manifest needs the digest of every file of a checkpoint (`elastrain.checkpoints.digest`: XXH3-128
unless the job asks for sha256). Reading every shard back after DCP wrote it costs a
second pass over all the bytes, on one rank. Instead each rank hashes the bytes of its own
shard files as they go to the file (`DigestingStream`), and returns the digests beside its
DCP write results. DCP gathers every rank's write results to the coordinator before it
writes `.metadata`, so the coordinator ends the save holding the digest of every shard
file without reading any of them (`DigestingWriter.shard_digests`).

What is hashed is exactly the sequence of bytes handed to the file, in order. DCP's shard
writer only appends (torch.save's zip writer writes in order), so that sequence is the
file's content. Anything that seeks or truncates makes a stream give up its digest, and
the committer hashes such a file from disk instead (`describe_files`), as it does for every
file without a streamed digest or whose size on disk differs from the count of bytes hashed.

Everything else is DCP's own `FileSystemWriter`: its file layout (one file per rank), its
write loop and its fsync. It extends `FileSystemWriter` and `FileSystem` (`create_stream`,
`write_data`, `finish`), internals that older torch releases shape differently: hence the
torch floor in pyproject.toml and `tests/unit/test_dcp_api_guard.py`.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from elastrain.checkpoints.digest import DEFAULT_ALGORITHM, new_hasher
from elastrain.checkpoints.manifest import FileEntry

# DCP's shard files; `.metadata` and our own files are small and hashed from disk.
SHARD_SUFFIX = ".distcp"
# Marks the write results that carry digests rather than tensor locations. They travel to
# the coordinator with DCP's own results and are taken out before `.metadata` is written,
# so the checkpoint's DCP metadata is exactly what a plain FileSystemWriter writes.
_DIGEST_FQN_PREFIX = "__elastrain_file_digest__/"


@dataclasses.dataclass(frozen=True, slots=True)
class StreamedDigest:
    """Digest (by `algorithm`) and length of the bytes written to one file, in order."""

    name: str
    size: int
    digest: str
    algorithm: str


class DigestingStream(io.RawIOBase):
    """A file opened for writing whose bytes are hashed on their way in. `record(size,
    digest)` is called at close when every byte was appended in order; a seek or a
    truncate gives the digest up (the committer then hashes the file from disk)."""

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
        self._digests: dict[str, StreamedDigest] = {}

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
            streamed = StreamedDigest(name=name, size=size, digest=digest, algorithm=algorithm)
            with self._lock:
                self._digests[name] = streamed

        with self._lock:
            self._digests.pop(name, None)  # a rewrite must never keep an old digest
        stream = DigestingStream(path, record, algorithm)
        try:
            yield cast(io.IOBase, stream)
        finally:
            stream.close()

    def take_digests(self) -> list[StreamedDigest]:
        with self._lock:
            out = list(self._digests.values())
            self._digests.clear()
        return out


class DigestingWriter(FileSystemWriter):
    """DCP's FileSystemWriter (one file per rank, fsync per file) whose shard files are
    hashed as they are written. After a save, on the coordinator, `shard_digests` maps
    every shard file name (relative to the checkpoint folder) to its size and digest (by
    `algorithm`, a `elastrain.checkpoints.digest` name)."""

    def __init__(self, path: str | os.PathLike[str], *, algorithm: str = DEFAULT_ALGORITHM) -> None:
        # Staging is the async save's stager's (checkpointer.py), so no staging options
        # here; sync_files: a file is durable before the manifest names it.
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self._digesting_fs = DigestingFileSystem(algorithm)
        self.fs = self._digesting_fs
        self.shard_digests: dict[str, FileEntry] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self._digesting_fs.take_digests()
        self.shard_digests = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        with without_zip_crc32():
            results = list(super().write_data(plan, planner).wait())
        results.extend(_digest_result(d) for d in self._digesting_fs.take_digests())
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
    """torch.save without the zip format's per-record crc32 while a shard is written.

    DCP writes every tensor with torch.save, whose zip writer computes a crc32 of each
    record by default: a third of the CPU of writing a shard (torch.save of 64 MB of fp32
    into memory: 51 ms with it, 36 ms without, on the 2-core bench machine), on top of the
    digest the manifest already holds for the whole file.
    torch.load never checks that crc32 (same load time with or without it), so dropping
    it loses no check a load makes. The flag is process-wide in torch; a torch.save
    elsewhere in the process during a shard write also goes without crc32, which nothing
    that reads it with torch.load can tell.
    """
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


def _digest_result(digest: StreamedDigest) -> WriteResult:
    return WriteResult(
        index=MetadataIndex(fqn=_DIGEST_FQN_PREFIX + digest.name),
        size_in_bytes=digest.size,
        storage_data=digest,
    )


def split_digest_results(
    results: Iterable[list[WriteResult]],
) -> tuple[dict[str, FileEntry], list[list[WriteResult]]]:
    """(file name -> entry, DCP's own results) from every rank's write results."""
    digests: dict[str, FileEntry] = {}
    dcp_results: list[list[WriteResult]] = []
    for rank_results in results:
        kept: list[WriteResult] = []
        for result in rank_results:
            if isinstance(result.storage_data, StreamedDigest):
                d = result.storage_data
                digests[d.name] = FileEntry(size=d.size, digest=d.digest, algorithm=d.algorithm)
            else:
                kept.append(result)
        dcp_results.append(kept)
    return digests, dcp_results
