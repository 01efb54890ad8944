"""Digests taken while writing, and async saves whose staging copy overlaps training.

- the digest the writer streams into the manifest is the digest of the file on disk, and
  the coordinator does not read any shard back to get it (not even another rank's);
- a shard corrupted after the commit is still refused on load;
- a save at step s holds the step-s values even when the tensors change in place right
  after `wait_staged()` (staging overlapped with the next step, as the training loop
  runs it).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_saver

import elastrain.checkpoints.integrity as integrity
from elastrain.checkpoints.catalog import find_latest_good, list_committed
from elastrain.checkpoints.dcp import ShardedCheckpointer
from elastrain.checkpoints.dcp.writer import DigestingFileSystem, DigestingStream
from elastrain.checkpoints.manifest import DEFAULT_ALGORITHM, read_manifest
from tests.unit.dist_utils import run_distributed
from tests.unit.test_checkpoints_dcp import (
    FIELDS,
    assert_same,
    build,
    ckpt_state,
    full_state,
    load_into_fresh,
    train,
)

torch.set_num_threads(1)


class HashSpy:
    """Records which files the committer hashes from disk."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._original = integrity.digest_file

    def __call__(self, path: str | os.PathLike[str], algorithm: str = DEFAULT_ALGORITHM) -> str:
        self.names.append(Path(path).name)
        return self._original(path, algorithm)

    def install(self) -> None:
        integrity.digest_file = self

    def remove(self) -> None:
        integrity.digest_file = self._original


def disk_digests(folder: Path) -> dict[str, str]:
    """Digest (the default algorithm) of every file of a checkpoint folder but its manifest."""
    return {
        p.name: integrity.digest_file(p)
        for p in folder.iterdir()
        if p.is_file() and p.name != "manifest.json"
    }


# -- one process ------------------------------------------------------------------------


def test_streamed_digests_equal_the_files_on_disk(tmp_path: Path) -> None:
    model, optim = build("plain")
    train(model, optim, 2, seed=0)
    spy = HashSpy()
    spy.install()
    try:
        ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=False)
        ckpt.save(step=2, attempt=0, state=ckpt_state(model, optim), manifest_fields=FIELDS,
                  rank_extra={"rng": torch.get_rng_state()})  # fmt: skip
    finally:
        spy.remove()
    folder = tmp_path / "step_000000002-a0"
    manifest = read_manifest(folder)
    on_disk = disk_digests(folder)
    shards = [n for n in manifest.files if n.endswith(".distcp")]
    assert shards, manifest.files
    for name, entry in manifest.files.items():
        assert entry["algorithm"] == DEFAULT_ALGORITHM, name
        assert entry["digest"] == on_disk[name], name
        assert entry["size"] == (folder / name).stat().st_size
    # Only the small files were read back: the shards' digests came from the write.
    assert sorted(spy.names) == sorted([".metadata", "rank_0.extra.pt"])


def test_corrupt_shard_after_streamed_commit_is_refused(tmp_path: Path) -> None:
    model, optim = build("plain")
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=True)
    train(model, optim, 1, seed=0)
    ckpt.save(step=1, attempt=0, state=ckpt_state(model, optim), manifest_fields={})
    ref = full_state(model, optim)
    ckpt.wait_staged()  # before the state changes in place, as the loop does
    train(model, optim, 1, seed=1)
    ckpt.save(step=2, attempt=0, state=ckpt_state(model, optim), manifest_fields={})
    assert [c.step for c in ckpt.close()] == [1, 2]

    shard = tmp_path / "step_000000002-a0" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x40  # same size: only the digest can tell
    shard.write_bytes(bytes(data))

    info, skipped = find_latest_good(tmp_path)
    assert info is not None and info.step == 1
    assert "digest mismatch: __0_0.distcp" in dict(skipped)[str(shard.parent)]
    got = load_into_fresh("plain", str(tmp_path), 1)
    assert got["step"] == 1
    assert_same(got["full"], ref)


def zip_record_crcs(data: bytes) -> list[int]:
    """The crc32 of every record named in the zip central directories found in `data`
    (a DCP shard is torch.save archives one after another)."""
    crcs, at = [], data.find(b"PK\x01\x02")
    while at >= 0:
        crcs.append(struct.unpack_from("<I", data, at + 16)[0])
        at = data.find(b"PK\x01\x02", at + 4)
    return crcs


@pytest.mark.parametrize("async_save", [False, True])
def test_shards_are_written_without_zip_crc32_and_the_setting_is_restored(
    tmp_path: Path, async_save: bool
) -> None:
    # The sha256 of the manifest covers every shard; the zip crc32 torch.save adds by
    # default was a third of a shard write's CPU and torch.load never checks it.
    model, optim = build("plain")
    train(model, optim, 1, seed=0)
    ref = full_state(model, optim)
    assert torch.serialization.get_crc32_options()
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=async_save)
    ckpt.save(step=1, attempt=0, state=ckpt_state(model, optim), manifest_fields=FIELDS)
    ckpt.close()
    assert torch.serialization.get_crc32_options()  # the caller's torch.save keeps its crc32

    crcs = zip_record_crcs((tmp_path / "step_000000001-a0" / "__0_0.distcp").read_bytes())
    assert len(crcs) > 10 and set(crcs) == {0}
    got = load_into_fresh("plain", str(tmp_path), 1)
    assert_same(got["full"], ref)

    # A save that fails in the middle of the write restores the setting all the same.
    torch.serialization.set_crc32_options(False)  # and restores what was set, not True
    try:
        failing = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=False)
        # DCP's CheckpointException is a BaseException.
        with pytest.raises(BaseException, match="disk full"), _fail_shard_writes():
            failing.save(step=2, attempt=0, state=ckpt_state(model, optim), manifest_fields=FIELDS)
        assert not torch.serialization.get_crc32_options()
    finally:
        torch.serialization.set_crc32_options(True)
    assert torch.serialization.get_crc32_options()


@contextmanager
def _fail_shard_writes() -> Iterator[None]:
    original = DigestingStream.write

    def write(self: DigestingStream, data: Any) -> int:
        raise OSError("disk full")

    DigestingStream.write = write  # type: ignore[method-assign]
    try:
        yield
    finally:
        DigestingStream.write = original  # type: ignore[method-assign]


def test_what_was_written_is_in_the_file_once_its_descriptor_is_asked_for(
    tmp_path: Path,
) -> None:
    # DCP's own shard writer (device tensors) fsyncs `stream.fileno()` with no flush before
    # it: a tail still in the buffer would miss that fsync.
    fs = DigestingFileSystem()
    data = os.urandom(100)  # less than the buffer: all of it still there
    with fs.create_stream(tmp_path / "__0_0.distcp", "wb") as stream:
        stream.write(data)
        os.fsync(stream.fileno())
        assert (tmp_path / "__0_0.distcp").read_bytes() == data


def test_a_stream_that_seeks_gives_no_digest(tmp_path: Path) -> None:
    fs = DigestingFileSystem()
    with fs.create_stream(tmp_path / "__0_0.distcp", "wb") as stream:
        stream.write(b"abcdef")
        stream.seek(0)
        stream.write(b"X")
    with fs.create_stream(tmp_path / "__0_1.distcp", "wb") as stream:
        stream.write(b"abcdef")
    with fs.create_stream(tmp_path / "other.bin", "wb") as stream:
        stream.write(b"abcdef")
    digests = fs.take_digests()
    assert set(digests) == {"__0_1.distcp"}  # the seeked file is hashed from disk instead
    assert digests["__0_1.distcp"]["digest"] == integrity.digest_file(tmp_path / "__0_1.distcp")
    assert digests["__0_1.distcp"]["size"] == 6


def test_streamed_digest_of_a_wrong_size_is_not_trusted(tmp_path: Path) -> None:
    (tmp_path / "__0_0.distcp").write_bytes(b"0123456789")
    (tmp_path / ".metadata").write_bytes(b"meta")
    stale = {"__0_0.distcp": integrity.FileEntry(size=4, digest="0" * 32, algorithm="xxh3-128")}
    files = integrity.describe_files(tmp_path, known=stale)
    assert files["__0_0.distcp"] == {
        "size": 10,
        "digest": integrity.digest_file(tmp_path / "__0_0.distcp"),
        "algorithm": "xxh3-128",
    }
    # Nor one by another algorithm than the manifest's.
    other = {"__0_0.distcp": integrity.FileEntry(size=10, digest="0" * 64, algorithm="sha256")}
    files = integrity.describe_files(tmp_path, known=other)
    assert files["__0_0.distcp"]["digest"] == integrity.digest_file(tmp_path / "__0_0.distcp")


# -- two FSDP ranks -----------------------------------------------------------------------


def _mutate(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    """Change every parameter and the optimizer state in place, as a training step does."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    train(model, optim, 1, seed=99)


def _hold_writes() -> tuple[threading.Event, Any]:
    """Hold DCP's write (in the checkpointer's thread) until the event is set, so the
    test changes the live tensors before a single byte is written."""
    gate = threading.Event()
    original = state_dict_saver.save

    def gated(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(60)
        return original(*args, **kwargs)

    state_dict_saver.save = gated  # the checkpointer looks it up at call time
    return gate, original


MODES = ("overlapped",)


def _fsdp_streaming(rank: int, world_size: int, base: str) -> dict[str, Any]:
    model, optim = build("fsdp")
    train(model, optim, 2, seed=1)
    out: dict[str, Any] = {"refs": {}}

    # Sync: rank 0 commits with both ranks' streamed digests and reads no shard back.
    spy = HashSpy()
    spy.install()
    try:
        sync = ShardedCheckpointer(Path(base, "sync"), rank=rank, world_size=world_size,
                                   async_save=False)  # fmt: skip
        sync.save(step=2, attempt=0, state=ckpt_state(model, optim), manifest_fields=FIELDS)
    finally:
        spy.remove()
    out["hashed_from_disk"] = spy.names

    # Async: the state changes right after wait_staged(), before DCP's write starts.
    for mode in MODES:
        step = 4
        train(model, optim, 1, seed=step)
        out["refs"][mode] = full_state(model, optim)
        ckpt = ShardedCheckpointer(Path(base, mode), rank=rank, world_size=world_size,
                                   async_save=True)  # fmt: skip
        gate, original = _hold_writes()
        try:
            ckpt.save(step=step, attempt=0, state=ckpt_state(model, optim), manifest_fields=FIELDS)
            ckpt.wait_staged()  # what the training loop does before the optimizer step
            assert ckpt.poll_commits() == []  # the write is still held
            _mutate(model, optim)
            gate.set()
            commits = ckpt.close()
        finally:
            state_dict_saver.save = original
        assert len(commits) == (1 if rank == 0 else 0)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def fsdp_streamed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    base = tmp_path_factory.mktemp("stream")
    results = run_distributed(_fsdp_streaming, 2, str(base), timeout_s=240)
    return base, results[0]


def test_coordinator_reads_no_shard_back(fsdp_streamed: tuple[Path, dict[str, Any]]) -> None:
    base, saved = fsdp_streamed
    # Rank 1's shard too: its digest came with its DCP write results.
    assert saved["hashed_from_disk"] == [".metadata"]
    folder = base / "sync" / "step_000000002-a0"
    manifest = read_manifest(folder)
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(manifest.files)
    on_disk = disk_digests(folder)
    assert {n: e["digest"] for n, e in manifest.files.items()} == on_disk


def _load_modes(rank: int, world_size: int, base: str) -> dict[str, Any]:
    return {m: load_into_fresh("fsdp", str(Path(base, m)), world_size) for m in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_async_save_holds_the_values_of_its_step(
    fsdp_streamed: tuple[Path, dict[str, Any]], mode: str
) -> None:
    base, saved = fsdp_streamed
    got = run_distributed(_load_modes, 1, str(base), timeout_s=120)[0][mode]
    assert got["step"] == 4
    assert_same(got["full"], saved["refs"][mode])


# -- the training loop ------------------------------------------------------------------


def _loop_with_async_saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Train 6 steps with async saves every 2, each save's write held until the next
    optimizer step has begun (so the save cannot finish, and clear its staging, on its
    own first); record at every optimizer step whether a staging copy was still pending."""
    import time

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    import elastrain.workers.loop as loop
    from elastrain.contracts.spec import JobSpec
    from elastrain.workers.api import TrainContext
    from tests.unit.hooks import RecordingHooks

    max_steps = 6
    made: list[ShardedCheckpointer] = []
    pending_at_update: list[bool] = []
    original_make_checkpointer = loop.make_checkpointer
    original_save = state_dict_saver.save

    requested_at: list[int] = []  # optimizer steps done when each save was asked for

    def make_checkpointer(ctx: Any, spec: Any) -> Any:
        made.append(original_make_checkpointer(ctx, spec))
        save = made[-1].save

        def noting_save(*args: Any, **kwargs: Any) -> Any:
            requested_at.append(len(pending_at_update))
            return save(*args, **kwargs)

        made[-1].save = noting_save  # type: ignore[method-assign]
        return made[-1]

    def before_update(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        # Every optimizer's step, but torch's own at lr 0 (`get_state_dict` initialising
        # the optimizer state: zero gradients, no weight changed).
        if optimizer.param_groups[0]["lr"] != 0:
            inflight = made[0]._inflight
            pending_at_update.append(inflight is not None and inflight.staged is not None)

    def held_save(*args: Any, **kwargs: Any) -> Any:
        # Counted when the loop asked for this save (one in flight at a time: first in,
        # first out), not when this thread got here: under load the next step may
        # already have begun its update by then.
        seen, deadline = requested_at.pop(0), time.monotonic() + 60
        # Held until the next step updates; the last save has no next step.
        while seen < max_steps and len(pending_at_update) == seen:
            if time.monotonic() > deadline:
                raise AssertionError(f"no optimizer step began after the save at step {seen}")
            time.sleep(0.005)
        return original_save(*args, **kwargs)

    loop.make_checkpointer = make_checkpointer
    register_optimizer_step_pre_hook(before_update)
    state_dict_saver.save = held_save
    spec = JobSpec.model_validate(
        {"name": "s", "workload": {"name": "synthetic", "params": {"num_samples": 64}},
         "training": {"global_batch_size": 8, "micro_batch_size": 4, "max_steps": max_steps},
         "checkpoint": {"every_steps": 2, "async_save": True}}
    )  # fmt: skip
    job = Path(root)
    ctx = TrainContext(
        rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"),
        job_id=1, attempt=0, checkpoint_root=job / "checkpoints", log_path=job / "rank0.log",
    )  # fmt: skip
    loop.train(ctx, spec, RecordingHooks())
    return {"pending": pending_at_update, "async_save": made[0].async_save}


def test_the_loop_never_updates_while_a_staging_copy_is_pending(tmp_path: Path) -> None:
    [out] = run_distributed(_loop_with_async_saves, 1, str(tmp_path), timeout_s=120)
    assert out["async_save"] is True
    assert len(out["pending"]) == 6 and not any(out["pending"])
    assert [i.step for i in list_committed(tmp_path / "checkpoints")] == [6, 4, 2]
