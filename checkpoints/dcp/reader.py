"""The storage side of a DCP load: every shard file read once, verified, then copied.

DCP's own `FileSystemReader` runs one `torch.load` per tensor through a file view (a read
into a fresh tensor, then a copy into the state's tensor), and verifying the checkpoint
first means a second pass over every byte. Here each rank, for each shard file its load
plan reads:

1. maps the file (`mmap`, read-only): the kernel reads it in, nothing is copied into a
   user buffer;
2. with digests expected, hashes the mapped bytes in file order (XXH3-128 by default,
   `elastrain.checkpoints.digest`, at memory speed; these are the same pages steps 3-4 then read);
3. agrees with every other rank that all of them found their files intact (one
   all-reduce) before any byte reaches the state, so a corrupt checkpoint leaves every
   rank's state untouched and the caller falls back to an older one, as it would after a
   verification pass on one rank;
4. decodes each tensor record of the file in place (`torch.load`'s own decoder, given the
   mapped bytes as the record's storage, as `torch.load(mmap=True)` does for a whole file)
   and copies it into the state's tensor: one copy, from the page cache.

So a verified load costs about one read of the files plus one copy into the state, and
the hash (~29 GB/s per core) is close to free (docs/bench-checkpoint.md).

Files not read by any rank's plan are not hashed here; `elastrain.checkpoints.catalog` checks the
small ones (`.metadata`, the rank extras) on rank 0 before the load starts.
"""

from __future__ import annotations

import io
import mmap
import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import IO, Any, cast

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future as TorchFuture

from elastrain.checkpoints.digest import new_hasher
from elastrain.checkpoints.integrity import CHUNK_BYTES, CorruptCheckpoint, digest_mismatch
from elastrain.checkpoints.manifest import FileEntry

try:  # torch.load's decoder, usable on bytes already in memory (torch 2.13's layout)
    import torch._weights_only_unpickler as _weights_only_unpickler
    from torch.serialization import _load as _torch_zip_load

    IN_PLACE_DECODE = callable(_torch_zip_load) and hasattr(torch._C, "PyTorchFileReader")
except ImportError:  # pragma: no cover - another torch layout: decode with torch.load
    IN_PLACE_DECODE = False


class VerifyingReader(FileSystemReader):
    """FileSystemReader that reads each shard file once, through a map, checks it against
    the manifest's digest on the way (when `expected` is given), and decodes the tensors
    from the mapped bytes.

    `expected`: the manifest's entries (file name -> size, digest, algorithm); None loads
    without hashing. `process_group`: the group every rank of the load is in (the
    agreement of step 3); None for a load without torch.distributed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        expected: Mapping[str, FileEntry] | None,
        process_group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__(path)
        self.expected = expected
        self.process_group = process_group
        self.in_place_decodes = 0  # tensors decoded from the mapped bytes (tests)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)

        with _mapped_files(os.fspath(self.path), sorted(per_file)) as mapped:
            problem = self._check(mapped) if self.expected is not None else None
            self._agree(problem)
            for name, items in per_file.items():
                self._copy_out(mapped[name], items, planner)
        done: TorchFuture[None] = TorchFuture()
        done.set_result(None)
        return done

    def _check(self, mapped: Mapping[str, memoryview | Exception]) -> str | None:
        """Why this rank's files are not what the manifest says, or None."""
        assert self.expected is not None
        for name, data in mapped.items():
            if isinstance(data, Exception):
                return f"cannot read {name}: {data}"
            entry = self.expected.get(name)
            if entry is None:
                return f"{name} is not in the manifest"
            if len(data) != entry["size"]:
                return f"size mismatch: {name} is {len(data)} bytes, manifest says {entry['size']}"
            hasher = new_hasher(entry["algorithm"])
            for start in range(0, len(data), CHUNK_BYTES):
                hasher.update(data[start : start + CHUNK_BYTES])
            mismatch = digest_mismatch(name, entry, hasher.hexdigest())
            if mismatch is not None:
                return mismatch
        return None

    def _agree(self, problem: str | None) -> None:
        """Raise CorruptCheckpoint on every rank when any rank found a problem; return on
        every rank otherwise. Every rank reaches this (an error reading a file is a
        problem found, not an exception), so the all-reduce always completes."""
        if self.process_group is not None and self.expected is not None:
            flag = torch.tensor([0 if problem is None else 1], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
            if problem is None and int(flag.item()) != 0:
                problem = "another rank found one of its shard files corrupt"
        if problem is not None:
            raise CorruptCheckpoint(self.path, problem)

    def _copy_out(
        self, data: memoryview | Exception, items: list[ReadItem], planner: LoadPlanner
    ) -> None:
        if isinstance(data, Exception):  # only when not verifying: DCP reports it
            raise data
        whole: torch.Tensor | None = None
        for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
            info = self.storage_data[item.storage_index]
            record = data[info.offset : info.offset + info.length]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(bytes(record)))
                continue
            if IN_PLACE_DECODE and not info.transform_descriptors:
                if whole is None:
                    whole = _as_tensor(data)
                storage = whole.untyped_storage()[info.offset : info.offset + info.length]
                tensor = _decode_in_place(record, storage)
                self.in_place_decodes += 1
            else:  # compressed or otherwise transformed records: DCP's own path
                stream = self.transforms.transform_load_stream(
                    item, info.transform_descriptors or (), io.BytesIO(bytes(record))
                )
                tensor = torch.load(
                    io.BytesIO(stream.read(-1)), map_location="cpu", weights_only=True
                )
            tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != tensor.size():
                raise AssertionError(
                    f"req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}"
                )
            target.copy_(tensor)
            planner.commit_tensor(item, target)
            del tensor, record


def _as_tensor(data: memoryview) -> torch.Tensor:
    """The mapped bytes as a uint8 tensor, without a copy. The map is read-only and the
    tensor is only ever a copy source, which torch's warning about that is for."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


class _RecordFile(io.RawIOBase):
    """One torch.save record (a zip) in memory, as the file torch's zip reader wants: it
    reads the directory and the pickle through it, never the tensor data."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data = data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._data)}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        chunk = self._data[self._pos : self._pos + len(buffer)]
        memoryview(buffer).cast("B")[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


def _decode_in_place(record: memoryview, storage: torch.UntypedStorage) -> torch.Tensor:
    """The tensor a torch.save record holds, its data left where it is (`storage`: the
    record's bytes): what torch.load(mmap=True) does for a whole file, for one record."""
    reader = torch._C.PyTorchFileReader(cast(IO[bytes], _RecordFile(record)))
    tensor = _torch_zip_load(reader, "cpu", _weights_only_unpickler, overall_storage=storage)
    return cast(torch.Tensor, tensor)


@contextmanager
def _mapped_files(root: str, names: list[str]) -> Iterator[dict[str, memoryview | Exception]]:
    """Each named file under root mapped read-only (an empty file: empty bytes), or the
    error opening it; unmapped on exit."""
    maps: list[mmap.mmap] = []
    views: dict[str, memoryview | Exception] = {}
    try:
        for name in names:
            try:
                with open(os.path.join(root, name), "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size == 0:
                        views[name] = memoryview(b"")
                        continue
                    m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
            except OSError as e:
                views[name] = e
                continue
            maps.append(m)
            if hasattr(m, "madvise"):
                m.madvise(mmap.MADV_SEQUENTIAL)  # read ahead generously: read once, in order
            views[name] = memoryview(m)
        yield views
    finally:
        # A tensor still viewing the bytes keeps them (BufferError): unmapped with it.
        for view in views.values():
            if isinstance(view, memoryview):
                with suppress(BufferError):
                    view.release()
        for m in maps:
            with suppress(BufferError):
                m.close()
