"""Shard files written with direct I/O: the same bytes and digests as through the page
cache, large data sent from the staged copy without a copy, and the page cache where a
file system refuses direct I/O.

Real files on disk; the refusal of `O_DIRECT` is simulated (every file system here
accepts it), the rest is the real path.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load

import elastrain.checkpoints.dcp.shard_file as shard_file
from elastrain.checkpoints import read_manifest
from elastrain.checkpoints.dcp import ShardedCheckpointer
from elastrain.checkpoints.dcp.host_memory import page_aligned_storage
from elastrain.checkpoints.dcp.shard_file import (
    ALIGN_RECORD_MIN_BYTES,
    BLOCK,
    DigestingStream,
    aligned_record_start,
    is_aligned,
)
from elastrain.checkpoints.dcp.staging import AlignedStateDictStager
from elastrain.checkpoints.digest import DEFAULT_ALGORITHM
from elastrain.checkpoints.integrity import digest_file

torch.set_num_threads(1)
BIG = ALIGN_RECORD_MIN_BYTES


@pytest.mark.parametrize(
    ("end", "prefix", "data", "start"),
    [
        (0, 0, BIG, 0),  # already aligned
        (0, 100, BIG, BLOCK - 100),  # data at the first block boundary after the header
        (BLOCK - 100, 100, BIG, BLOCK - 100),  # the header ends on a boundary: no gap
        (5, 64, BIG, BLOCK - 64),
        (BLOCK + 1, 64, BIG, 2 * BLOCK - 64),
        (BLOCK - 10, 64, BIG, 2 * BLOCK - 64),  # header would cross: the next boundary
        (123, 100, BIG - 1, 123),  # small data: where the file ends, as DCP writes it
        (123, 100, 10, 123),
    ],
)
def test_where_a_record_goes(end: int, prefix: int, data: int, start: int) -> None:
    assert aligned_record_start(end, prefix, data) == start


def aligned_bytes(data: bytes) -> memoryview:
    """`data` at a page-aligned address."""
    buffer = mmap.mmap(-1, len(data))
    buffer[:] = data
    return memoryview(buffer)


def write_pieces(path: Path, pieces: list[Any], *, direct: bool) -> tuple[DigestingStream, Any]:
    got: dict[str, Any] = {}
    stream = DigestingStream(
        path, lambda size, digest: got.update(size=size, digest=digest), direct=direct
    )
    for i, piece in enumerate(pieces):
        stream.write(piece)
        if i == len(pieces) // 2:
            os.fsync(stream.fileno())  # a flush mid-file (DCP's writer does it at the end)
            assert path.stat().st_size == stream.tell()
    stream.close()
    return stream, got


def mixed_pieces(seed: int) -> list[Any]:
    """Headers, small records, large ones at aligned and unaligned addresses, tails."""
    rng = random.Random(seed)
    pieces: list[Any] = []
    for _ in range(40):
        size = rng.choice([1, 7, 100, BLOCK - 1, BLOCK, BLOCK + 3, 3 * BLOCK, 70_000, 2_000_003])
        data = rng.randbytes(size)
        kind = rng.choice(["bytes", "aligned", "offset"])
        if kind == "aligned":
            pieces.append(aligned_bytes(data))
        elif kind == "offset":
            pieces.append(memoryview(aligned_bytes(b"x" + data))[1:])  # 1 byte off a page
        else:
            pieces.append(data)
    # Pad to a block boundary once, then an aligned large piece: the no-copy path.
    pieces.append(bytes(-sum(len(p) for p in pieces) % BLOCK))
    pieces.append(aligned_bytes(rng.randbytes(3 * BLOCK + 5)))
    return pieces


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_direct_and_page_cache_write_the_same_file_and_digest(tmp_path: Path, seed: int) -> None:
    pieces = mixed_pieces(seed)
    expected = b"".join(bytes(p) for p in pieces)
    for direct in (True, False):
        path = tmp_path / f"__0_{int(direct)}.distcp"
        stream, got = write_pieces(path, pieces, direct=direct)
        assert stream.direct is direct  # the file systems here all take O_DIRECT
        assert path.read_bytes() == expected
        assert got == {"size": len(expected), "digest": digest_file(path, DEFAULT_ALGORITHM)}


def test_aligned_data_goes_to_the_disk_without_a_copy(tmp_path: Path, gathered: list[int]) -> None:
    header, body = b"h" * (BLOCK - 10), aligned_bytes(os.urandom(8 * BLOCK + 17))
    _, got = write_pieces(tmp_path / "__0_0.distcp", [b"z" * 10, header, body], direct=True)
    assert (tmp_path / "__0_0.distcp").read_bytes() == b"z" * 10 + header + bytes(body)
    assert sum(gathered) == BLOCK + 17  # the headers and the body's tail; the body's 8 blocks not
    assert got["size"] == BLOCK + 8 * BLOCK + 17


def refuse_direct_open(monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def fake_open(path: Any, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(shard_file.os, "open", fake_open)


def refuse_direct_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Direct I/O accepted at open, refused at the first write (some FUSE mounts)."""
    real_pwrite = os.pwrite
    refused: list[int] = []

    def fake_pwrite(fd: int, data: Any, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(shard_file.os, "pwrite", fake_pwrite)
    return refused


@pytest.mark.parametrize("refuse", ["at-open", "at-first-write"])
def test_a_file_system_refusing_direct_io_gets_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refuse: str
) -> None:
    pieces = mixed_pieces(7)
    expected = b"".join(bytes(p) for p in pieces)
    refused: list[int] = []
    if refuse == "at-open":
        refuse_direct_open(monkeypatch)
    else:
        refused = refuse_direct_writes(monkeypatch)
    path = tmp_path / "__0_0.distcp"
    stream, got = write_pieces(path, pieces, direct=True)
    assert stream.direct is False
    assert len(refused) == (1 if refuse == "at-first-write" else 0)
    assert path.read_bytes() == expected
    assert got == {"size": len(expected), "digest": digest_file(path, DEFAULT_ALGORITHM)}


def test_the_environment_turns_direct_io_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(shard_file.DIRECT_IO_ENV, "0")
    assert not shard_file.direct_io_wanted()
    monkeypatch.setenv(shard_file.DIRECT_IO_ENV, "1")
    assert shard_file.direct_io_wanted()


def test_large_storages_are_staged_page_aligned_and_reused() -> None:
    stager = AlignedStateDictStager()
    big, small = torch.randn(BIG // 4 + 3), torch.randn(10)
    state = {"w": big, "s": small, "view": big[4:]}
    staged = stager.stage(state)
    assert is_aligned(memoryview(staged["w"].numpy()).cast("B"))
    assert torch.equal(staged["w"], big) and torch.equal(staged["s"], small)
    # A view shares the staged storage, as it shares the original's.
    assert staged["view"].untyped_storage().data_ptr() == staged["w"].untyped_storage().data_ptr()
    big.add_(1.0)
    again = stager.stage(state)
    assert again["w"].untyped_storage().data_ptr() == staged["w"].untyped_storage().data_ptr()
    assert torch.equal(again["w"], big)
    assert page_aligned_storage(BLOCK + 1).nbytes() == BLOCK + 1


def big_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {
        "model": {
            "w1": torch.randn(512, 700),  # 1.4 MB: a record with aligned data
            "b1": torch.randn(700),
            "w2": torch.randn(300, 1024).to(torch.bfloat16),  # 0.6 MB: packed as DCP does
            "w3": torch.randn(1024, 1024),
        },
        "count": 3,
    }


@pytest.mark.parametrize("async_save", [True, False])
def test_large_records_start_their_data_on_a_block_and_torch_reads_them(
    tmp_path: Path, async_save: bool, gathered: list[int]
) -> None:
    state = big_state(0)
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=async_save)
    ckpt.save(step=1, attempt=0, state=state, manifest_fields={})
    ckpt.close()
    folder = tmp_path / "step_000000001-a0"
    shard = folder / "__0_0.distcp"
    # The streamed digest is the file's.
    assert read_manifest(folder).files["__0_0.distcp"]["digest"] == digest_file(shard)
    metadata = FileSystemReader(folder).read_metadata()
    raw = shard.read_bytes()
    for index, info in metadata.storage_data.items():
        tensor = (
            state["model"][index.fqn.split(".")[-1]] if index.fqn.startswith("model.") else None
        )
        if tensor is None:
            continue
        data = memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")
        at = raw.find(bytes(data[:64]), info.offset, info.offset + info.length)
        assert at >= 0, index.fqn
        if len(data) >= ALIGN_RECORD_MIN_BYTES:
            assert at % BLOCK == 0, index.fqn
    # An async save sends the large tensors' staged copies to the disk as they are; a
    # synchronous one copies the live tensors through the bounce buffer, but for those
    # torch's allocator happened to put at a page boundary (which go straight).
    copied = sum(gathered)
    small = sum(t.nbytes for t in state["model"].values() if t.nbytes < ALIGN_RECORD_MIN_BYTES)
    if async_save:
        assert copied < small + 3 * BLOCK * len(state["model"]), copied
    else:
        unaligned = sum(t.nbytes for t in state["model"].values() if t.data_ptr() % BLOCK)
        assert copied >= unaligned, copied
    # Torch's own reader, no elastrain code on the load path.
    target = big_state(1)
    dcp_load(target, storage_reader=FileSystemReader(folder), no_dist=True)
    for key, value in state["model"].items():
        assert torch.equal(target["model"][key], value), key
    assert target["count"] == 3


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the writes shard files make to the disk."""
    sizes: list[int] = []
    real_pwrite = os.pwrite

    def counting(fd: int, data: Any, offset: int) -> int:
        sizes.append(len(data))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(shard_file.os, "pwrite", counting)
    return sizes


def test_flushes_after_every_small_record_cost_no_write_each(
    tmp_path: Path, writes: list[int]
) -> None:
    # torch.save flushes its file after every tensor; with direct I/O each flush would be
    # a synchronous disk write of a padded block.
    pieces = [os.urandom(1000) for _ in range(200)]
    path = tmp_path / "__0_0.distcp"
    got: dict[str, Any] = {}
    with DigestingStream(path, lambda size, digest: got.update(size=size), direct=True) as stream:
        for piece in pieces:
            stream.write(piece)
            stream.flush()
    assert path.read_bytes() == b"".join(pieces)
    assert got == {"size": 200_000}
    assert len(writes) <= 2, writes  # the whole blocks, then the padded last one


def test_closing_after_the_fsync_writes_nothing_again(tmp_path: Path, writes: list[int]) -> None:
    # DCP's writer and ours fsync `fileno()` and then close: the padded last block is
    # written once, before the fsync.
    path = tmp_path / "__0_0.distcp"
    with DigestingStream(path, lambda size, digest: None, direct=True) as stream:
        stream.write(b"x" * 100)
        os.fsync(stream.fileno())
    assert writes == [BLOCK]
    assert path.read_bytes() == b"x" * 100
