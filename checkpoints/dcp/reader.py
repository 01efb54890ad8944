"""The storage side of a DCP load: every shard file read once, verified, then copied.

DCP's own `FileSystemReader` runs one `torch.load` per tensor through a file view (a read
into a fresh tensor, then a copy into the state's tensor), and verifying the checkpoint
first means a second pass over every byte. Here:

1. the coordinator, seeing every rank's load plan, gives each file that any rank reads
   one hashing rank (`HashDuty`: the rank that reads most of it; also any rank that reads
   half of it or more). Without that, a rank reading a few replicated optimizer values
   from another rank's shard (DCP stores them once) read and hashed that whole file too;
2. each rank maps the files it hashes (`mmap`, read-only: the kernel reads them in,
   nothing is copied into a user buffer) and hashes them in file order (XXH3-128 by
   default, `elastrain.checkpoints.digest`, at memory speed). Its own shard is mapped and
   hashed in a thread while DCP plans the load (`prefetch`);
3. the records a rank reads from a file another rank hashes: small ones (`SHIP_BYTES`)
   are sent by that rank, from its verified map; larger ones are read here and their
   digests compared with the ones that rank took from its verified map;
4. every rank agrees with every other (one all-gather of verdicts, digests and small
   records) that all files and records are intact before any byte reaches the state,
   so a corrupt checkpoint leaves every rank's state untouched and the caller falls back
   to an older one, as it would after a verification pass on one rank;
5. each tensor record is decoded in place (`torch.load`'s own decoder, given the mapped
   bytes as the record's storage, as `torch.load(mmap=True)` does for a whole file; a
   record laid out as one seen before, byte for byte but its data, is viewed from that
   layout without the pickle) and copied into the state's tensor: one copy, from the
   page cache.

So a verified load costs about one read of the files plus one copy into the state, and
the hash (~29 GB/s per core) is close to free (docs/bench-checkpoint.md).

Files not read by any rank's plan are not hashed here; `elastrain.checkpoints.catalog` checks
the small ones (`.metadata`, the rank extras) on rank 0 before the load starts.
"""

from __future__ import annotations

import dataclasses
import io
import mmap
import os
import re
import stat
import warnings
from collections.abc import Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from typing import IO, Any, cast

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future as TorchFuture

from elastrain.checkpoints.dcp.records import ZipLayouts
from elastrain.checkpoints.digest import DEFAULT_ALGORITHM, new_hasher
from elastrain.checkpoints.integrity import CHUNK_BYTES, CorruptCheckpoint, digest_mismatch
from elastrain.checkpoints.manifest import FileEntry

#: Shard files are opened without following a link: a job's code writes its checkpoint
#: folder, and a link planted there must not make a load (or an export) read elsewhere.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW

try:  # torch.load's decoder, usable on bytes already in memory (torch 2.13's layout)
    import torch._weights_only_unpickler as _weights_only_unpickler
    from torch.serialization import _load as _torch_zip_load

    IN_PLACE_DECODE = callable(_torch_zip_load) and hasattr(torch._C, "PyTorchFileReader")
except ImportError:  # pragma: no cover - another torch layout: decode with torch.load
    IN_PLACE_DECODE = False


@dataclass(frozen=True, slots=True)
class HashDuty:
    """What one rank hashes in a verified load, chosen by the coordinator from every
    rank's load plan (`VerifyingReader.prepare_global_plan`): each file any rank reads is
    hashed whole by exactly one rank, the one that reads most of it. `shared`: for each of
    those files, the records (offset, length) other ranks read from it; their digests
    (taken from the same verified map) are what those ranks check their own reads
    against."""

    files: tuple[str, ...]
    shared: dict[str, tuple[tuple[int, int], ...]]


RecordKey = tuple[str, int, int]  # (file, offset, length)

# Records of another rank's file up to this size are sent by the rank that verified the
# file, in the agreement's all-gather, instead of read here: they are usually the
# replicated optimizer scalars and param groups, a few bytes each at scattered offsets,
# whose cold reads (one disk round trip each) cost more than the whole exchange.
SHIP_BYTES = 256 * 1024


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
        self.in_place_decodes = 0  # tensors decoded from the loaded bytes, not copied (tests)
        self.layout_hits = 0  # of those, decoded from a remembered layout (tests)
        self.hashed_bytes = 0  # bytes this rank hashed (tests)
        self.received_records: list[RecordKey] = []  # sent by their file's hashing rank
        self.self_read_records: list[RecordKey] = []  # of others' files, read and checked here
        # Record layouts seen in this load: the bytes of a record's zip entries other than
        # its tensor data -> the tensor they decode to (dtype, size, stride, offset) and
        # where its data lies. Records that agree on every such byte decode alike.
        self._layouts: dict[bytes, tuple[torch.dtype, torch.Size, tuple[int, ...], int]] = {}
        self._zips = ZipLayouts()
        # Maps open for this load (closed by close()), and the background verification
        # started by prefetch(): file -> (its map or the error opening it, the problem
        # found in it or None).
        self._open = ExitStack()
        self._pool: ThreadPoolExecutor | None = None
        self._prefetched: Future[dict[str, tuple[memoryview | Exception, str | None]]] | None = None

    def prefetch(self, names: Collection[str]) -> None:
        """Start mapping and verifying `names` in a background thread while DCP plans
        the load (the reads and the hash release the GIL, the planning is CPU work): the
        files this rank's plan will most likely make it hash, i.e. its own shard at an
        unchanged world size. A guess: a prefetched file the plan does not give this
        rank is only unmapped at close()."""
        if self._pool is not None:
            return
        known = sorted(name for name in names if self.expected is None or name in self.expected)
        if known:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-verify")
            self._prefetched = self._pool.submit(self._map_and_check, known)

    def close(self) -> None:
        """Wait for any background verification and unmap every file. Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._prefetched = None
        self._open.close()

    def _map_and_check(
        self, names: list[str]
    ) -> dict[str, tuple[memoryview | Exception, str | None]]:
        views = self._open.enter_context(_mapped_files(os.fspath(self.path), names))
        if self.expected is None:  # not verifying: only fault the pages in, in order
            for view in views.values():
                if isinstance(view, memoryview):
                    _touch(view)
            return {name: (view, None) for name, view in views.items()}
        return {name: (view, self._file_problem(name, view)) for name, view in views.items()}

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """(Coordinator.) Give each rank its HashDuty. Without this a rank reading a few
        small records of another rank's file (the replicated optimizer scalars DCP stores
        once) would read and hash that whole file too: twice the bytes on that rank."""
        plans = super().prepare_global_plan(plans)
        read: dict[str, dict[int, int]] = {}  # file -> rank -> bytes it reads
        records: dict[str, dict[int, set[tuple[int, int]]]] = {}
        for rank, plan in enumerate(plans):
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                by_rank = read.setdefault(info.relative_path, {})
                by_rank[rank] = by_rank.get(rank, 0) + info.length
                records.setdefault(info.relative_path, {}).setdefault(rank, set()).add(
                    (info.offset, info.length)
                )
        hashers: dict[str, set[int]] = {}
        primary: dict[str, int] = {}
        for name, by_rank in read.items():
            writer = _writer_rank(name)
            primary[name] = min(by_rank, key=lambda r: (-by_rank[r], r != writer, r))
            entry = self.expected.get(name) if self.expected is not None else None
            size = entry["size"] if entry is not None else _size(self.path, name)
            # Whoever reads half the file or more hashes it itself (e.g. every rank of a
            # DDP load reads every file whole); the others get their records from the
            # primary hasher.
            hashers[name] = {primary[name]} | {r for r, n in by_rank.items() if 2 * n >= size}
        out = []
        for rank, plan in enumerate(plans):
            files = tuple(sorted(name for name, ranks in hashers.items() if rank in ranks))
            shared = {
                name: tuple(
                    sorted(
                        {
                            rec
                            for r, recs in records[name].items()
                            if r not in hashers[name]
                            for rec in recs
                        }
                    )
                )
                for name in files
                if primary[name] == rank
            }
            out.append(dataclasses.replace(plan, storage_data=HashDuty(files=files, shared=shared)))
        return out

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)

        duty = plan.storage_data if isinstance(plan.storage_data, HashDuty) else None
        if duty is None:  # no duty from the coordinator: map (and hash) every file read
            whole_files, foreign = sorted(per_file), []
        else:
            whole_files = list(duty.files)
            foreign = sorted(set(per_file) - set(duty.files))
        try:
            mapped, known = self._map(whole_files)
            records: dict[RecordKey, memoryview] = {}
            problem: str | None = None
            shared: dict[RecordKey, str] = {}
            shipped: dict[RecordKey, bytes] = {}
            mine: dict[RecordKey, str] = {}
            if foreign:
                problem = self._read_foreign({name: per_file[name] for name in foreign}, records)
                if problem is not None and self.expected is None:
                    raise OSError(problem)  # not verifying: reported, as DCP's reader would
            if self.expected is not None:
                try:
                    if problem is None:
                        problem = self._check(mapped, known, duty, shared, shipped)
                    if problem is None:
                        mine = self._record_digests(records)
                except Exception as e:  # a problem found: the peers wait in the all-gather
                    problem = f"verification failed: {e!r}"
                self.self_read_records = sorted(records)
                received = self._agree(problem, shared, shipped, mine)
                for name in foreign:
                    for item in per_file[name]:
                        info = self.storage_data[item.storage_index]
                        key = (name, info.offset, info.length)
                        if key not in records:
                            records[key] = memoryview(received[key])
                            self.received_records.append(key)
            for name, items in per_file.items():
                if name in mapped:
                    self._copy_out(mapped[name], items, planner)
                else:
                    self._copy_out_records(name, records, items, planner)
        finally:
            self.close()
        done: TorchFuture[None] = TorchFuture()
        done.set_result(None)
        return done

    def _map(
        self, names: list[str]
    ) -> tuple[dict[str, memoryview | Exception], dict[str, str | None]]:
        """`names` mapped (by prefetch() or now), and the verdicts prefetch() reached."""
        prefetched: dict[str, tuple[memoryview | Exception, str | None]] = {}
        if self._prefetched is not None:
            with suppress(Exception):  # whatever went wrong there is found again here
                prefetched = self._prefetched.result()
        views = {name: prefetched[name][0] for name in names if name in prefetched}
        known = {name: prefetched[name][1] for name in names if name in prefetched}
        rest = [name for name in names if name not in prefetched]
        if rest:
            views.update(self._open.enter_context(_mapped_files(os.fspath(self.path), rest)))
        return views, known

    def _read_foreign(
        self, per_file: Mapping[str, list[ReadItem]], out: dict[RecordKey, memoryview]
    ) -> str | None:
        """Read the records this rank needs from files another rank hashes, each into
        its own buffer (no read-ahead: they are usually a few small records scattered
        through a large file). Why not, or None."""
        for name, items in per_file.items():
            try:
                fd = os.open(os.path.join(self.path, name), _OPEN_FLAGS)
            except OSError as e:
                return f"cannot read {name}: {e}"
            try:
                with suppress(OSError):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                for item in items:
                    info = self.storage_data[item.storage_index]
                    key = (name, info.offset, info.length)
                    if key in out or (self.expected is not None and info.length <= SHIP_BYTES):
                        # Verifying, a small record is sent by the file's hashing rank.
                        continue
                    buf = bytearray(info.length)
                    got = os.preadv(fd, [buf], info.offset) if info.length else 0
                    if got != info.length:
                        return f"cannot read {name}: {got} of {info.length} bytes at {info.offset}"
                    out[key] = memoryview(buf)
            except OSError as e:
                return f"cannot read {name}: {e}"
            finally:
                os.close(fd)
        return None

    def _check(
        self,
        mapped: Mapping[str, memoryview | Exception],
        known: Mapping[str, str | None],
        duty: HashDuty | None,
        shared: dict[RecordKey, str],
        shipped: dict[RecordKey, bytes],
    ) -> str | None:
        """Why this rank's files are not what the manifest says, or None (`known`: the
        verdicts already reached in the background). For the records other ranks read
        from them, fills `shipped` with the bytes of the small ones and `shared` with
        the digests of the others."""
        assert self.expected is not None
        for name, data in mapped.items():
            problem = known[name] if name in known else self._file_problem(name, data)
            if problem is not None:
                return problem
            assert isinstance(data, memoryview)
            entry = self.expected[name]
            for offset, length in duty.shared.get(name, ()) if duty is not None else ():
                if offset + length > len(data):
                    return f"{name} has no bytes {offset}..{offset + length}"
                if length <= SHIP_BYTES:
                    shipped[(name, offset, length)] = bytes(data[offset : offset + length])
                else:
                    shared[(name, offset, length)] = _digest(
                        entry["algorithm"], data[offset : offset + length]
                    )
        return None

    def _file_problem(self, name: str, data: memoryview | Exception) -> str | None:
        """Why one mapped file is not what the manifest says, or None."""
        assert self.expected is not None
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
        self.hashed_bytes += len(data)
        return digest_mismatch(name, entry, hasher.hexdigest())

    def _record_digests(self, records: Mapping[RecordKey, memoryview]) -> dict[RecordKey, str]:
        assert self.expected is not None
        out = {}
        for key, data in records.items():
            entry = self.expected.get(key[0])
            algorithm = entry["algorithm"] if entry is not None else DEFAULT_ALGORITHM
            out[key] = _digest(algorithm, data)
            self.hashed_bytes += len(data)
        return out

    def _agree(
        self,
        problem: str | None,
        shared: dict[RecordKey, str],
        shipped: dict[RecordKey, bytes],
        mine: dict[RecordKey, str],
    ) -> dict[RecordKey, bytes]:
        """Raise CorruptCheckpoint on every rank when any rank found a problem, or read a
        record of another rank's file that is not the bytes that rank verified; return
        on every rank otherwise, with every small record any rank sent. Every rank
        reaches this (an error reading a file is a problem found, not an exception), so
        the all-gather always completes, and every rank judges the same gathered facts,
        so all decide alike."""
        views: list[Any] = [(problem, shared, shipped, mine)]
        me = 0
        if self.process_group is not None:
            views = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(
                views, (problem, shared, shipped, mine), group=self.process_group
            )
            me = dist.get_rank(self.process_group)
        verified: dict[RecordKey, str] = {}
        received: dict[RecordKey, bytes] = {}
        for _problem, their_shared, their_shipped, _mine in views:
            verified.update(their_shared)
            received.update(their_shipped)
        problems: dict[int, str] = {}
        for rank, (their_problem, _shared, _shipped, their_reads) in enumerate(views):
            if their_problem is None:
                for (name, offset, length), digest in sorted(their_reads.items()):
                    if verified.get((name, offset, length)) != digest:
                        their_problem = (
                            f"record mismatch: {name} bytes {offset}..{offset + length} as "
                            f"rank {rank} read them are not the bytes its hashing rank verified"
                        )
                        break
            if their_problem is not None:
                problems[rank] = their_problem
        if problems:
            raise CorruptCheckpoint(
                self.path,
                problems.get(me, "another rank found one of its shard files corrupt"),
            )
        return received

    def _copy_out(
        self, data: memoryview | Exception, items: list[ReadItem], planner: LoadPlanner
    ) -> None:
        if isinstance(data, Exception):  # only when not verifying: DCP reports it
            raise data
        whole: torch.Tensor | None = None
        for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
            info = self.storage_data[item.storage_index]
            record = data[info.offset : info.offset + info.length]
            if item.type != LoadItemType.BYTE_IO and whole is None:
                whole = _as_tensor(data)
            self._load_item(item, record, whole, info.offset, planner)
            del record

    def _copy_out_records(
        self,
        name: str,
        records: Mapping[RecordKey, memoryview],
        items: list[ReadItem],
        planner: LoadPlanner,
    ) -> None:
        for item in items:
            info = self.storage_data[item.storage_index]
            record = records[(name, info.offset, info.length)]
            whole = _as_tensor(record) if item.type != LoadItemType.BYTE_IO else None
            self._load_item(item, record, whole, 0, planner)

    def _load_item(
        self,
        item: ReadItem,
        record: memoryview,
        whole: torch.Tensor | None,
        base: int,
        planner: LoadPlanner,
    ) -> None:
        """Decode one record (`record`: its bytes, which are `whole[base:]`) and copy it
        into the state."""
        info = self.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(bytes(record)))
            return
        if IN_PLACE_DECODE and not info.transform_descriptors and len(record):
            assert whole is not None
            tensor = self._decode(record, whole, base)
            self.in_place_decodes += 1
        else:  # compressed or otherwise transformed records: DCP's own path
            stream = self.transforms.transform_load_stream(
                item, info.transform_descriptors or (), io.BytesIO(bytes(record))
            )
            tensor = torch.load(io.BytesIO(stream.read(-1)), map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise AssertionError(
                f"req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    def _decode(self, record: memoryview, whole: torch.Tensor, base: int) -> torch.Tensor:
        """The tensor a torch.save record holds, its data left in place. The first record
        of each layout goes through torch's decoder (its pickle unpickled, weights only);
        a later record whose bytes, but its data and serialization id, are those of an
        earlier one decodes to the same dtype, shape and strides over its own data, so
        it is viewed directly: no pickle, no zip reader. (Those were 1-1.5 ms a record,
        most of the decoding time of a load, on the bench's 2 busy cores.)"""
        layout = self._zips.key(record)
        if layout is not None:
            key, data_start, data_len = layout
            known = self._layouts.get(key)
            if known is not None:
                dtype, size, stride, storage_offset = known
                start = base + data_start
                storage = whole.untyped_storage()[start : start + data_len]
                self.layout_hits += 1
                return torch.empty((0,), dtype=dtype).set_(storage, storage_offset, size, stride)
        storage = whole.untyped_storage()[base : base + len(record)]
        tensor = _decode_in_place(record, storage)
        if layout is not None and _plain_view_of(tensor, storage, layout[1], layout[2]):
            self._layouts[layout[0]] = (
                tensor.dtype,
                tensor.size(),
                tuple(tensor.stride()),
                int(tensor.storage_offset()),
            )
        return tensor


def _touch(data: memoryview) -> None:
    """Fault every page of a map in, in order: hashing is the cheapest full read."""
    hasher = new_hasher(DEFAULT_ALGORITHM)
    for start in range(0, len(data), CHUNK_BYTES):
        hasher.update(data[start : start + CHUNK_BYTES])


def _size(root: str | os.PathLike[str], name: str) -> int:
    try:
        st = os.lstat(os.path.join(root, name))
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _writer_rank(name: str) -> int | None:
    """The rank that wrote a DCP shard file (`__<rank>_<n>.distcp`), or None."""
    match = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
    return int(match.group(1)) if match else None


def _digest(algorithm: str, data: memoryview) -> str:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def _plain_view_of(
    tensor: torch.Tensor, record_storage: torch.UntypedStorage, data_start: int, data_len: int
) -> bool:
    """Whether `tensor` is a plain strided CPU tensor over exactly the record's data
    entry: what a remembered layout can rebuild (not a subclass, quantized, conjugated
    or negated view, whose state a layout would not carry)."""
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
        return False
    if tensor.is_quantized or tensor.is_conj() or tensor.is_neg() or tensor.device.type != "cpu":
        return False
    storage = tensor.untyped_storage()
    return (
        storage.data_ptr() - record_storage.data_ptr() == data_start
        and storage.nbytes() == data_len
    )


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
                with open(os.open(os.path.join(root, name), _OPEN_FLAGS), "rb") as f:
                    found = os.fstat(f.fileno())
                    if not stat.S_ISREG(found.st_mode):
                        raise OSError(f"{name} is not a regular file")
                    size = found.st_size
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
