"""Sharded save/load with torch.distributed.checkpoint (DCP): every rank saves and loads
its shard; group rank 0 commits (`elastrain.checkpoints.commit`) and picks what to load.

Async saves copy the state (staging) and write and commit the copy in a background
thread. With `async_staging` the copy too is made in the background and save() returns at
once; the caller must then call `wait_staged()` before anything mutates the saved tensors
in place (the training loop: before the optimizer step), so that no later update leaks
into the checkpoint. A save given a copy of the state made at its step (`held_copy`:
peer memory's) writes that and makes no copy of its own; an async save of a state every
rank holds whole (DDP) copies only what its rank writes (`own_items`); an in-place save
writes the live tensors, and `wait_staged()` copies only those not yet written
(`live_tensors`).

Loads read each shard file once, verifying its digest on the way, on the ranks that read
it (`elastrain.checkpoints.dcp.reader`); rank 0 checks the small files while choosing the
checkpoint, and a shard found corrupt makes every rank fall back to the next older one.
"""

from __future__ import annotations

import io
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException

from elastrain.checkpoints._fs import atomic_write_bytes
from elastrain.checkpoints.catalog import LoadOutcome, find_latest_good
from elastrain.checkpoints.commit import commit, manifest_for, uncommit
from elastrain.checkpoints.dcp import kept_save
from elastrain.checkpoints.dcp.held_copy import HeldCopy
from elastrain.checkpoints.dcp.live_tensors import LiveTensors
from elastrain.checkpoints.dcp.own_items import OwnItemsStager
from elastrain.checkpoints.dcp.reader import VerifyingReader
from elastrain.checkpoints.dcp.save_plans import KeptPlanSavePlanner
from elastrain.checkpoints.dcp.staging import LayoutStager, copy_non_tensors
from elastrain.checkpoints.dcp.writer import SHARD_SUFFIX, DigestingWriter
from elastrain.checkpoints.digest import DEFAULT_ALGORITHM, algorithm_for_setting
from elastrain.checkpoints.integrity import CorruptCheckpoint
from elastrain.checkpoints.layout import rank_extra_name, step_dir
from elastrain.checkpoints.manifest import Manifest
from elastrain.contracts.messages import CheckpointCommitted

# DCP warns at every save without collectives that it assumes a single process: that is
# what a group of one is (ShardedCheckpointer._save_alone), not a mistake to report.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)


class CheckpointSaveError(RuntimeError):
    """A checkpoint save (usually a background one) failed; no commit was made for it."""

    def __init__(self, step: int, attempt: int, path: Path, cause: BaseException) -> None:
        super().__init__(
            f"checkpoint of step {step} (attempt {attempt}) at {path} failed: {cause!r}"
        )
        self.step = step
        self.attempt = attempt
        self.path = path


class ShardedCheckpointer:
    """Used by every rank of a worker group (or by a lone process without a process group).

    Async saves run in threads (never a helper process): measured on CPU hosts, that costs
    training least in total, the helper process's start included (docs/bench-checkpoint.md,
    "Threads, not a helper process"). The write spends its time in syscalls and the
    digest (XXH3-128 unless `digest="sha256"`), which release the GIL.

    The staging copy (what makes an async save immune to later updates) is made by one
    `LayoutStager` kept for the checkpointer's life: its copy buffers are allocated at the
    first save and reused (one more copy of this rank's state stays in host memory), so
    later saves do not page-fault fresh memory in, and copy bytes only while the state's
    layout stays the same; the large ones are page-aligned, so the shard writer sends them
    to the disk without a copy (`staging`, `shard_file`). With
    `async_staging` the copy runs in the stager's thread and save() returns before it is
    made; the caller then owes a `wait_staged()` before it mutates the state (see the
    module docstring). Saves given a `copy` (peer memory's, page-aligned too) stage
    nothing: the stager, and its copy of the state, is made only for a save without one.
    A save of a `replicated` state (DDP) stages the items this rank writes alone
    (`own_items`), about 1/N of the state, not the whole of it on every rank.
    """

    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        world_size: int,
        async_save: bool,
        async_staging: bool = False,
        process_group: dist.ProcessGroup | None = None,
        verify_digests: bool = True,
        owner: str = "",
        digest: str = DEFAULT_ALGORITHM,
        template_records: bool = True,
        direct_io: bool | None = None,
        keep_plans: bool = True,
    ) -> None:
        """`process_group`: the group DCP and the load broadcast use (a CPU one). None creates a
        dedicated gloo group, so every rank must construct the checkpointer at the same
        point (new_group is collective). A separate gloo group is what lets async saves run
        collectives from a background thread while training uses the default group (which
        may be NCCL) on the main thread, and keeps checkpoint collectives out of the
        training group's sequence.

        `async_staging` (async saves only): save() returns before the staging copy is made;
        the caller must call `wait_staged()` before it next mutates the saved tensors in
        place. Off, save() returns once the copy is made (nothing is owed).

        `digest`: the algorithm of the digests the manifests of its saves carry (a
        `checkpoint.digest` setting, 'xxh3' or 'sha256', or a `elastrain.checkpoints.digest` name).
        Loads verify each file by the algorithm its manifest names, whatever this is.

        `template_records`: write tensor records from per-layout templates rather than
        one torch.save per tensor (`DigestingWriter`; the same bytes). Off only to compare
        (bench/checkpoint_gil.py).

        `direct_io`: write shard files with direct I/O where the file system takes it
        (`shard_file`; off, through the page cache). None: on unless the environment sets
        `ELASTRAIN_CHECKPOINT_DIRECT_IO=0`.

        `keep_plans`: DCP's save plans are kept from save to save while the state's layout
        holds (`save_plans`; the same plans, files and metadata), and once every rank holds
        them a save makes none of DCP's exchanges of plans, results and metadata
        (`kept_save`). Off only to compare (bench/checkpoint_gil.py, checkpoint_plans.py).

        Retention is not done here: the service prunes (`elastrain.checkpoints.retention`).
        """
        if async_staging and not async_save:
            raise ValueError("async_staging needs async_save")
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.async_save = async_save
        self.async_staging = async_staging
        self.verify_digests = verify_digests
        self.digest_algorithm = algorithm_for_setting(digest)
        self.template_records = template_records
        self.direct_io = direct_io
        self.keep_plans = keep_plans
        self._planner = KeptPlanSavePlanner()
        self.owner = owner  # the database whose job this is: commits check the fence names it
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._distributed:
            self._pg: dist.ProcessGroup | None = (
                process_group if process_group is not None else dist.new_group(backend="gloo")
            )
            self._coordinator = dist.get_rank(self._pg) == 0
            # A group of one saves without DCP's collectives: they pickle every plan and
            # write result (and unpickle them, garbage-collecting as they go) only to
            # hand them to this same rank, all while holding the GIL that a training
            # thread beside an async save waits for (docs/bench-checkpoint.md, "GIL
            # wait"). The plans, files and `.metadata` are the same.
            self._save_alone = dist.get_world_size(self._pg) == 1
        else:
            if world_size != 1:
                raise ValueError("world_size > 1 needs an initialised torch.distributed")
            self._pg = None
            self._coordinator = True
            self._save_alone = True
        # One background thread: it writes (after the staging copy is made), then (rank 0)
        # commits. Saves never overlap because save() waits for the previous one first.
        self._executor: ThreadPoolExecutor | None = None
        self._stager: LayoutStager | None = None
        self._own_stager: OwnItemsStager | None = None
        # What wait_staged() waits for: the staging copy, or an in-place save's live tensors.
        self._staging: Future[Any] | LiveTensors | None = None
        self._inflight: Future[CheckpointCommitted | None] | None = None
        self._inflight_id: tuple[int, int, Path] | None = None
        self._inflight_copy: HeldCopy | None = None
        self._pending: list[CheckpointCommitted] = []
        self._last_saved: tuple[int, int] | None = None
        self.last_tensor_write_s: float | None = None
        """Seconds from the latest save's start in its thread to its last tensor written
        (DCP's planning and the tensor records, not the fsync or the commit): how long an
        in-place save reads the live tensors."""
        self.last_taken_back_bytes = 0
        """Bytes the latest in-place save copied at `wait_staged()` (not yet written then)."""

    # ---------------------------------------------------------------------------------
    # save
    # ---------------------------------------------------------------------------------

    def save(
        self,
        *,
        step: int,
        attempt: int,
        state: dict[str, Any],
        manifest_fields: dict[str, Any],
        rank_extra: dict[str, Any] | None = None,
        copy: HeldCopy | None = None,
        replicated: bool = False,
        sync: bool = False,
        in_place: bool = False,
    ) -> float:
        """Save `state` (as from `get_state_dict`) as checkpoint (step, attempt). Every rank
        calls it at the same step. Returns the seconds the caller was blocked (including
        waiting for a previous async save).

        `copy`: this rank's items of the save already copied at this step (peer memory's
        snapshot, `held_copy`): the save writes them instead of `state`'s data, and makes
        no staging copy; `state` may change once this returns. Released (`copy.release`)
        when the save no longer reads it. Every rank passes one or none does.

        `replicated`: every rank's `state` is the same (DDP): an async save's staging copy
        is then of the items this rank writes alone (`own_items`), not the whole state.

        `sync`: written in the caller even when saves are async, as the last save of an
        attempt is (its caller waits for the commit anyway: a staging copy would be work
        and host memory for nothing).

        `in_place` (async saves with `async_staging`): no staging copy either; the live
        tensors of `state` are written in the background (the non-tensor values are copied
        now). `wait_staged()` returns once the save no longer reads them: the write is
        over, or the tensor being written is and the ones not yet written are copied then
        (`live_tensors`), so the caller's next update waits at most for a copy of what is
        left. For a host-memory state (`elastrain.workers.checkpointing.writes_in_place`).
        Ignored with a `copy` or `sync`."""
        if in_place and not self.async_staging:
            raise ValueError("in_place needs async_staging: the caller must wait for the write")
        try:
            return self._save(
                step, attempt, state, manifest_fields, rank_extra, copy, replicated, sync,
                in_place,
            )  # fmt: skip
        except BaseException:
            if copy is not None and (self._inflight is None or self._inflight_copy is not copy):
                copy.release()  # never handed to the write
            raise

    def _save(
        self,
        step: int,
        attempt: int,
        state: dict[str, Any],
        manifest_fields: dict[str, Any],
        rank_extra: dict[str, Any] | None,
        copy: HeldCopy | None,
        replicated: bool,
        sync: bool,
        in_place: bool,
    ) -> float:
        started = time.perf_counter()
        self._wait_inflight()
        if copy is not None and copy.step != step:
            raise ValueError(f"a copy of step {copy.step} given to the save of step {step}")
        if self._last_saved == (step, attempt):
            if copy is not None:
                copy.release()
            # E.g. a CHECKPOINT control then a STOP at the same step: already saved. Every
            # rank makes the same decision (same call sequence), so collectives stay aligned.
            return time.perf_counter() - started
        manifest = manifest_for(step, attempt, manifest_fields, world_size=self.world_size)
        path = step_dir(self.root, step, attempt)
        path.mkdir(parents=True, exist_ok=True)
        if self._coordinator:
            uncommit(path)
        extra = None
        if rank_extra is not None:
            # Serialised now (the RNG states of this step), written with the shard.
            buf = io.BytesIO()
            torch.save(rank_extra, buf)
            extra = buf.getvalue()

        if self.async_save and not sync:
            # From a held copy the live state is not read again once planned: no staging.
            staged: dict[str, Any] | Future[Any] = state
            written: HeldCopy | Future[HeldCopy] | None = copy
            live: LiveTensors | None = None
            if copy is None and in_place:
                staged = copy_non_tensors(state)
                live = self._staging = LiveTensors()
                self.last_taken_back_bytes = 0
            elif copy is None and replicated and self.world_size > 1:
                written = self._staging = self._stage_own_items(state, step)
            elif copy is None:
                staged = self._stage(state)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt")
            self._inflight_id = (step, attempt, path)
            self._inflight_copy = copy
            self._inflight = self._executor.submit(
                self._write_and_commit, path, manifest, staged, extra, written, live
            )
            if not self.async_staging:
                self.wait_staged()
        else:
            commit = self._write_and_commit(path, manifest, state, extra, copy)
            if commit is not None:
                self._pending.append(commit)
        self._last_saved = (step, attempt)
        return time.perf_counter() - started

    def _stage(self, state: dict[str, Any]) -> Future[Any]:
        """Start the staging copy of `state` in the stager's thread."""
        if self._stager is None:
            # Pinned buffers and non-blocking device copies only where there is a device
            # to copy from.
            self._stager = LayoutStager(device_copies=torch.accelerator.is_available())
        staged = self._staging = self._stager.stage(state)
        return staged

    def _stage_own_items(self, state: dict[str, Any], step: int) -> Future[HeldCopy]:
        """Start the staging copy of the items this rank writes of a replicated state."""
        if self._own_stager is None:
            self._own_stager = OwnItemsStager(
                self.rank, self.world_size, pin=torch.accelerator.is_available()
            )
        return self._own_stager.stage(state, step)

    def wait_staged(self) -> float:
        """Block until the in-flight async save's staging copy is made; from then on the
        saved tensors may change. Returns the seconds waited. Raises CheckpointSaveError
        here, in the caller, when the copy failed: this rank then stops as it would on a
        failed synchronous save, rather than train on while its peers wait in the save's
        collectives for a write that will never start."""
        staging, self._staging = self._staging, None
        if staging is None:
            return 0.0
        started = time.perf_counter()
        try:
            if isinstance(staging, LiveTensors):
                staging.take_back()
                self.last_taken_back_bytes = staging.copied_bytes
            else:
                staging.result()
        except BaseException as e:
            if self._inflight_id is None:
                raise
            step, attempt, path = self._inflight_id
            raise CheckpointSaveError(step, attempt, path, e) from e
        return time.perf_counter() - started

    def _write_and_commit(
        self,
        path: Path,
        manifest: Manifest,
        state: dict[str, Any] | Future[Any],
        extra: bytes | None,
        copy: HeldCopy | Future[HeldCopy] | None = None,
        live: LiveTensors | None = None,
    ) -> CheckpointCommitted | None:
        """Steps 1-3 of the commit protocol (`elastrain.checkpoints.commit`), in the caller (sync)
        or the background thread. `live`: an in-place save's live tensors, which the
        writer claims and is told the write ended through."""
        try:
            if extra is not None:
                atomic_write_bytes(path / rank_extra_name(self.rank), extra)
            resolved: dict[str, Any] = state.result() if isinstance(state, Future) else state
            if isinstance(copy, Future):
                copy = copy.result()
            started = time.perf_counter()  # the write alone, not the wait for its copy
            planner = self._planner if self.keep_plans else KeptPlanSavePlanner()
            planner.write_from(copy)
            writer = DigestingWriter(
                path,
                algorithm=self.digest_algorithm,
                template_records=self.template_records,
                direct_io=self.direct_io,
                live=live,
            )
            if self.keep_plans:
                kept_save.save(
                    resolved, writer=writer, planner=planner, group=self._pg, alone=self._save_alone
                )
            else:  # looked up on the module at call time (tests hold the write by patching it)
                state_dict_saver.save(
                    resolved,
                    storage_writer=writer,
                    planner=planner,
                    process_group=self._pg,
                    no_dist=self._save_alone,
                )
        except BaseException as e:
            self._planner.forget()
            if live is not None:
                live.write_ended(e)
            raise
        finally:
            self._planner.write_from(None)
            if isinstance(copy, HeldCopy):
                copy.release()  # written (or failed): its owner may write into it again
        self.last_tensor_write_s = (writer.tensors_written_at or time.perf_counter()) - started
        if live is not None:
            live.write_ended()
        if not self._coordinator:
            return None
        return commit(
            self.root,
            path,
            manifest,
            streamed=writer.shard_digests,
            owner=self.owner,
            algorithm=self.digest_algorithm,
        )

    def _wait_inflight(self) -> None:
        """Block until the in-flight async save (if any) is done; raise if it failed."""
        if self._inflight is not None:
            self._collect(block=True)

    def _collect(self, *, block: bool) -> None:
        fut, ident = self._inflight, self._inflight_id
        if fut is None or ident is None or (not block and not fut.done()):
            return
        # The write is over, so is its staging (a failed one is reported just below).
        self._inflight, self._inflight_id, self._staging = None, None, None
        self._inflight_copy = None
        try:
            result = fut.result()
        # DCP's CheckpointException derives from BaseException, not Exception.
        except BaseException as e:
            step, attempt, path = ident
            raise CheckpointSaveError(step, attempt, path, e) from e
        if result is not None:
            self._pending.append(result)

    # ---------------------------------------------------------------------------------
    # commits
    # ---------------------------------------------------------------------------------

    def poll_commits(self) -> list[CheckpointCommitted]:
        """Commits made since the last call (group rank 0; [] elsewhere). Non-blocking.
        Raises CheckpointSaveError, on the ranks where it is observed, when the background
        save failed: a lost checkpoint is never silent."""
        self._collect(block=False)
        out, self._pending = self._pending, []
        return out

    def finalize(self) -> list[CheckpointCommitted]:
        """Wait for the in-flight save; return the commits not yet polled."""
        self._wait_inflight()
        out, self._pending = self._pending, []
        return out

    def close(self) -> list[CheckpointCommitted]:
        """finalize() and release the background threads and the staging buffers."""
        try:
            return self.finalize()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._own_stager is not None:
                self._own_stager.close()
                self._own_stager = None

    # ---------------------------------------------------------------------------------
    # load
    # ---------------------------------------------------------------------------------

    def load_latest(self, state: dict[str, Any]) -> LoadOutcome | None:
        """Load the newest good committed checkpoint into `state` in place (DCP reshards
        to the current world size). Every rank calls it; group rank 0 chooses (names,
        sizes, and the digests of the files other than shards) and broadcasts its choice
        so all ranks load the same checkpoint even if one is committed meanwhile. The
        shards are verified by the ranks that read them, all of them before any byte
        reaches the state (`VerifyingReader`); a corrupt one makes every rank go on to
        the next older checkpoint, `state` untouched. None when there is no good one."""
        self._wait_inflight()  # never read a folder we are still writing
        refused: dict[str, str] = {}
        while True:
            choice: list[Any] = [None]
            if self._coordinator:
                choice[0] = find_latest_good(
                    self.root,
                    verify_digests=self.verify_digests,
                    digest_here=lambda name: not name.endswith(SHARD_SUFFIX),
                    refused=refused,
                )
            if self._distributed:
                dist.broadcast_object_list(choice, group=self._pg, group_src=0)
            info, skipped = choice[0]
            if info is None:
                return None
            reader = VerifyingReader(
                info.path,
                expected=info.manifest.files if self.verify_digests else None,
                process_group=self._pg,
            )
            if info.world_size == self.world_size:
                # This rank's own shard is what its plan will most likely have it verify:
                # read and hash it while DCP plans (reader.prefetch).
                reader.prefetch(
                    [
                        name
                        for name in info.manifest.files
                        if name.startswith(f"__{self.rank}_") and name.endswith(SHARD_SUFFIX)
                    ]
                )
            try:
                dcp.load(
                    state,
                    storage_reader=reader,
                    process_group=self._pg,
                    no_dist=not self._distributed,
                )
            except (CheckpointException, CorruptCheckpoint) as e:
                corrupt = corrupt_shard_reason(e)
                if corrupt is None:
                    raise
                # Every rank got the same failures (the reader's agreement), so every
                # rank makes this choice; rank 0 picks again without this folder.
                refused[str(info.path)] = corrupt
                continue
            finally:
                reader.close()
            break
        rank_extra = None
        extra_path = info.path / rank_extra_name(self.rank)
        if info.world_size == self.world_size and extra_path.is_file():
            # Our own file (digest-checked on rank 0); RNG states hold tuples and numpy
            # arrays, which weights_only loading refuses.
            rank_extra = torch.load(extra_path, map_location="cpu", weights_only=False)
        return LoadOutcome(info=info, skipped=skipped, rank_extra=rank_extra)


def corrupt_shard_reason(error: BaseException) -> str | None:
    """Why a DCP load failed when it failed only because a `VerifyingReader` found a
    shard corrupt (on any rank), else None (a failure to report, not to fall back on)."""
    if isinstance(error, CorruptCheckpoint):
        return error.reason
    if not isinstance(error, CheckpointException) or not error.failures:
        return None
    reasons = []
    for failure, _trace in error.failures.values():
        if not isinstance(failure, CorruptCheckpoint):
            return None
        reasons.append(failure.reason)
    # The rank that found the problem says what it is; the others only that it was found.
    return min(reasons, key=lambda r: r.startswith("another rank"))
