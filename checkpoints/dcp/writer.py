"""The storage side of a DCP save: shard files digested while they are written.

The manifest needs the digest of every file of a checkpoint (`elastrain.checkpoints.digest`: XXH3-128
unless the job asks for sha256). Reading every shard back after
DCP wrote it costs a second pass over all the bytes, on one rank. Instead each rank hashes
the bytes of its own shard files as they go to the file (`shard_file.DigestingStream`,
which also writes them with direct I/O where it can), and returns
the digests beside its DCP write results. DCP gathers every rank's write results to the
coordinator before it writes `.metadata`, so the coordinator ends the save holding the
digest of every shard file without reading any of them (`DigestingWriter.shard_digests`).

What is hashed is exactly the sequence of bytes handed to the file, in order. DCP's shard
writer only appends (torch.save's zip writer refuses to write out of order), so that
sequence is the file's content. Anything that seeks or truncates makes a stream give up its
digest, and the committer hashes such a file from disk instead (`describe_files`), as it
does for every file without a streamed digest or whose size on disk differs from the count
of bytes hashed.

It extends DCP's `FileSystemWriter` and `FileSystem` (`create_stream`, `write_data`,
`finish`), internals that older torch releases shape differently: hence the torch floor in
pyproject.toml.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import time
from collections.abc import Generator, Iterable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import IO, cast

import torch
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystem,
    FileSystemWriter,
    SerializationFormat,
    _item_size,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from elastrain.checkpoints.dcp.live_tensors import LiveTensors
from elastrain.checkpoints.dcp.shard_file import DigestingStream, aligned_record_start
from elastrain.checkpoints.dcp.tensor_records import record_parts, serialization_settings
from elastrain.checkpoints.digest import DEFAULT_ALGORITHM
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


class DigestingFileSystem(FileSystem):
    """DCP's local file system, with shard files opened for writing through a digest."""

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM, direct_io: bool | None = None) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.direct_io = direct_io
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
        name = path.name

        def record(size: int, digest: str) -> None:
            streamed = StreamedDigest(name=name, size=size, digest=digest, algorithm=algorithm)
            with self._lock:
                self._digests[name] = streamed

        algorithm = self.algorithm
        with self._lock:
            self._digests.pop(name, None)  # a rewrite must never keep an old digest
        digesting = DigestingStream(path, record, algorithm, direct=self.direct_io)
        try:
            # Duck-typed: DCP's writer only uses the methods DigestingStream offers.
            yield cast(io.IOBase, digesting)
        finally:
            digesting.close()

    def take_digests(self) -> list[StreamedDigest]:
        with self._lock:
            out = list(self._digests.values())
            self._digests.clear()
        return out


class DigestingWriter(FileSystemWriter):
    """FileSystemWriter (one file per rank, fsync per file) whose shard files are hashed
    as they are written. After a save, on the coordinator, `shard_digests` maps every
    shard file name (relative to the checkpoint folder) to its size and digest (by
    `algorithm`, a `elastrain.checkpoints.digest` name).

    `template_records` (default): the shard is written by `_write_shard`, which writes
    each plain CPU tensor's torch.save record from a per-layout template
    (`tensor_records`) instead of running torch.save for it: the same bytes, a fraction
    of the Python. Off: DCP's own writer loop (kept for comparison, bench/checkpoint_gil.py).

    `direct_io`: shard files written with direct I/O where the file system takes it
    (`shard_file`); None: unless `ELASTRAIN_CHECKPOINT_DIRECT_IO=0`.

    `live`: the state's tensors are the live ones (an in-place save): each is claimed
    from it while written, so that the caller may take the rest back as copies
    (`live_tensors`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        algorithm: str = DEFAULT_ALGORITHM,
        template_records: bool = True,
        direct_io: bool | None = None,
        live: LiveTensors | None = None,
    ) -> None:
        # The staging copy is made by the checkpointer's own stager (checkpointer.py), so
        # no staging options here; sync_files: a file is durable before the manifest
        # names it.
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.template_records = template_records
        self.live = live
        self.tensors_written_at: float | None = None
        """`time.perf_counter()` when the last tensor record was handed to the file (before
        the fsync); None when DCP's own loop wrote them."""
        self._digesting_fs = DigestingFileSystem(algorithm, direct_io)
        self.fs = self._digesting_fs
        self.shard_digests: dict[str, FileEntry] = {}
        self.written: list[WriteResult] | None = None
        """This rank's results of the save (where its items went; not the digests)."""
        self.finished: list[list[WriteResult]] | None = None
        """On the coordinator, every rank's `written`, once the metadata is written."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self._digesting_fs.take_digests()
        self.shard_digests = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        with without_zip_crc32():
            shard = self._write_shard(plan, planner) if self._one_plain_shard() else None
            if shard is None and self.live is not None:
                self.live.unmanaged()  # DCP's loop writes the live tensors: no claims
            results = shard if shard is not None else list(super().write_data(plan, planner).wait())
        self.written = list(results)
        results.extend(_digest_result(d) for d in self._digesting_fs.take_digests())
        out: TorchFuture[list[WriteResult]] = TorchFuture()
        out.set_result(results)
        return out

    def _one_plain_shard(self) -> bool:
        """Whether DCP's writer would write this rank's items into one file by one thread,
        untransformed, with torch.save: the case `_write_shard` reproduces."""
        return (
            self.template_records
            and self.single_file_per_rank
            and self.thread_count == 1
            and not self.transforms.extensions
            and self.serialization_format == SerializationFormat.TORCH_SAVE
        )

    def _write_shard(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult] | None:
        """What `FileSystemWriter.write_data` does for one file written by one thread
        (`_write_files_from_queue`): the same file name, the same order of items (byte
        items first, then tensors, ordered by size where DCP's loader would copy them
        from an accelerator), the same records and fsync; tensor records from templates
        where `record_parts` has one. One difference in place: a record with large data
        starts after a few zero bytes, so that its data starts at a block boundary and
        goes to the disk straight from the staged copy (`shard_file`); DCP reads each
        record by the offset and length this returns, so no reader sees those bytes.
        None (nothing written) when a tensor is not in host memory (a synchronous save
        of device tensors): DCP's loader overlaps those copies, so its writer does that
        save."""
        file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        path = self.fs.concat_path(self.path, file_name)
        byte_items = [wi for wi in plan.items if wi.type == WriteItemType.BYTE_IO]
        tensor_items = [wi for wi in plan.items if wi.type != WriteItemType.BYTE_IO]
        if _dcp_overlapping_loader(self.per_thread_copy_ahead):
            tensor_items.sort(key=_item_size)  # stable, as the loader's sort
        tensors = []
        for item in tensor_items:
            tensor = planner.resolve_data(item)
            assert isinstance(tensor, torch.Tensor)
            if not tensor.is_cpu:
                return None
            tensors.append(tensor.detach())
        if self.live is not None:
            self.live.register(tensors)
        settings = serialization_settings()
        results: list[WriteResult] = []
        with self.fs.create_stream(path, "wb") as stream:
            for item in byte_items:
                data = planner.resolve_data(item)
                assert isinstance(data, io.BytesIO)
                offset = stream.tell()
                stream.write(data.getbuffer())
                results.append(_result(item, file_name, offset, stream.tell() - offset))
            for item, listed in zip(tensor_items, tensors, strict=True):
                with self._reading(listed) as tensor:
                    if tensor.untyped_storage().size() != tensor.numel() * tensor.itemsize:
                        tensor = tensor.clone()  # as DCP's loaders: minimal storage
                    parts = record_parts(tensor, settings)
                    if parts is None:
                        offset = stream.tell()
                        torch.save(tensor, cast(IO[bytes], stream))
                    else:
                        prefix, body, _suffix = parts
                        end = stream.tell()
                        offset = aligned_record_start(end, len(prefix), len(body))
                        stream.write(bytes(offset - end))  # so large data is block-aligned
                        for part in parts:
                            stream.write(part)
                results.append(_result(item, file_name, offset, stream.tell() - offset))
            self.tensors_written_at = time.perf_counter()
            stream.flush()
            if self.sync_files:
                os.fsync(stream.fileno())
        return results

    def _reading(self, tensor: torch.Tensor) -> AbstractContextManager[torch.Tensor]:
        """`tensor`, or in an in-place save the claimed live tensor or its copy."""
        return self.live.claim() if self.live is not None else nullcontext(tensor)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        digests, dcp_results = split_digest_results(results)
        self.shard_digests = digests
        super().finish(metadata, dcp_results)
        self.finished = dcp_results


_crc32_lock = threading.Lock()
_crc32_off_depth = 0  # writes in progress (saves of several checkpointers may overlap)
_crc32_saved = True  # the setting to restore when the last of them ends


@contextmanager
def without_zip_crc32() -> Generator[None, None, None]:
    """torch.save without the zip format's per-record crc32 while a shard is written.

    DCP writes every tensor with torch.save, whose zip writer computes a crc32 of each
    record by default: a large share of the CPU of writing a shard (docs/bench-checkpoint.md),
    on top of the digest the manifest already holds for the whole file.
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


def _dcp_overlapping_loader(copy_ahead: int) -> bool:
    """Whether DCP's one-thread writer loads tensors with its overlapping (accelerator)
    loader, which writes them smallest first, rather than in plan order."""
    backend = getattr(torch, torch._C._get_privateuse1_backend_name(), None)
    return copy_ahead > 0 and (
        torch.cuda.is_available() or bool(backend and backend.is_available())
    )


def _result(item: WriteItem, file_name: str, offset: int, length: int) -> WriteResult:
    return WriteResult(
        index=item.index,
        size_in_bytes=length,
        storage_data=_StorageInfo(file_name, offset, length, transform_descriptors=None),
    )


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
