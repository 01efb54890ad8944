"""Sharded save/load with torch.distributed.checkpoint (DCP): every rank saves and loads
its shard; group rank 0 commits (`elastrain.checkpoints.commit`) and picks what to load.

Saves are DCP's own: `dcp.save` for a synchronous one, `dcp.async_save` with DCP's
`DefaultStager` (the staging copy made in its thread, into buffers it keeps from save to
save; pinned, with non-blocking copies, where there is a device) and DCP's save planner
with plan caching (once the state's layout holds, no plans are exchanged). The caller must
call `wait_staged()` before anything mutates the saved tensors in place (the training
loop: before the optimizer step), so that no later update leaks into the checkpoint.
What is ours: the writer that hashes each shard as it is written (`writer`), and the
commit (fence check, manifest last), made on rank 0 once DCP's upload is over.

The upload runs in DCP's thread, not its checkpoint process
(`AsyncCheckpointerType.PROCESS`): that process is made once per trainer process with a
process group of the world size it was made at, which an elastic job's warm process
outlives, and the thread's write measured no slower on the steps beside it
(docs/bench-checkpoint.md, "Thread or process").

Loads are DCP's own, each rank verifying the digest of every shard file it reads before
any byte reaches the state (`elastrain.checkpoints.dcp.reader`); rank 0 checks the small
files while choosing the checkpoint, and a shard found corrupt makes every rank fall back
to the next older one.
"""

from __future__ import annotations

import io
import itertools
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from elastrain.checkpoints._fs import atomic_write_bytes
from elastrain.checkpoints.catalog import LoadOutcome, find_latest_good
from elastrain.checkpoints.commit import commit, manifest_for, uncommit
from elastrain.checkpoints.dcp.reader import VerifyingReader
from elastrain.checkpoints.dcp.writer import SHARD_SUFFIX, DigestingWriter
from elastrain.checkpoints.digest import DEFAULT_ALGORITHM, algorithm_for_setting
from elastrain.checkpoints.integrity import CorruptCheckpoint
from elastrain.checkpoints.layout import rank_extra_name, step_dir
from elastrain.checkpoints.manifest import Manifest
from elastrain.contracts.messages import CheckpointCommitted

# DCP warns at every save without collectives that it assumes a single process: that is
# what a group of one is, not a mistake to report.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)

_planner_keys = itertools.count()


class CheckpointSaveError(RuntimeError):
    """A checkpoint save (usually a background one) failed; no commit was made for it."""

    def __init__(self, step: int, attempt: int, path: Path, cause: BaseException) -> None:
        super().__init__(
            f"checkpoint of step {step} (attempt {attempt}) at {path} failed: {cause!r}"
        )
        self.step = step
        self.attempt = attempt
        self.path = path


class _InFlight:
    """An async save DCP is writing: its futures and what names it in errors."""

    def __init__(self, ident: tuple[int, int, Path], staged: Future[None], done: Future[Any]):
        self.ident = ident
        self.staged: Future[None] | None = staged
        self.done = done


class ShardedCheckpointer:
    """Used by every rank of a worker group (or by a lone process without a process group),
    one per attempt: DCP's plan cache and the stager's buffers are this attempt's."""

    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        world_size: int,
        async_save: bool,
        process_group: dist.ProcessGroup | None = None,
        owner: str = "",
        digest: str = DEFAULT_ALGORITHM,
    ) -> None:
        """`process_group`: the group DCP and the load broadcast use (a CPU one). None creates a
        dedicated gloo group, so every rank must construct the checkpointer at the same
        point (new_group is collective). A separate gloo group is what lets async saves run
        collectives from a background thread while training uses the default group (which
        may be NCCL) on the main thread, and keeps checkpoint collectives out of the
        training group's sequence.

        `digest`: the algorithm of the digests the manifests of its saves carry (a
        `checkpoint.digest` setting, 'xxh3' or 'sha256', or a `elastrain.checkpoints.digest` name).
        Loads verify each file by the algorithm its manifest names, whatever this is.

        Retention is not done here: the service prunes (`elastrain.checkpoints.retention`).
        """
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.async_save = async_save
        self.digest_algorithm = algorithm_for_setting(digest)
        self.owner = owner  # the database whose job this is: commits check the fence names it
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._distributed:
            self._pg: dist.ProcessGroup | None = (
                process_group if process_group is not None else dist.new_group(backend="gloo")
            )
            self._coordinator = dist.get_rank(self._pg) == 0
        else:
            if world_size != 1:
                raise ValueError("world_size > 1 needs an initialised torch.distributed")
            self._pg = None
            self._coordinator = True
        # DCP caches plans per planner class, process-wide: a key of this checkpointer's
        # own, so that a warm process's next attempt (another group, another world size)
        # never meets this one's plans.
        self._planner = DefaultSavePlanner(enable_plan_caching=True)
        self._planner._cached_plans_key = f"elastrain-{next(_planner_keys)}"
        self._stager: DefaultStager | None = None
        self._inflight: _InFlight | None = None
        self._pending: list[CheckpointCommitted] = []
        self._last_saved: tuple[int, int] | None = None

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
        sync: bool = False,
    ) -> float:
        """Save `state` (as from `get_state_dict`) as checkpoint (step, attempt). Every rank
        calls it at the same step. Returns the seconds the caller was blocked (including
        waiting for a previous async save).

        `sync`: written in the caller even when saves are async, as the last save of an
        attempt is (its caller waits for the commit anyway: a staging copy would be work
        and host memory for nothing)."""
        started = time.perf_counter()
        self._wait_inflight()
        if self._last_saved == (step, attempt):
            # E.g. a CHECKPOINT control then a STOP at the same step: already saved. Every
            # rank makes the same decision (same call sequence), so collectives stay aligned.
            return time.perf_counter() - started
        manifest = manifest_for(step, attempt, manifest_fields, world_size=self.world_size)
        path = step_dir(self.root, step, attempt)
        path.mkdir(parents=True, exist_ok=True)
        if self._coordinator:
            uncommit(path)
        if rank_extra is not None:
            # Serialised now (the RNG states of this step), written with the shard.
            buf = io.BytesIO()
            torch.save(rank_extra, buf)
            atomic_write_bytes(path / rank_extra_name(self.rank), buf.getvalue())
        writer = DigestingWriter(path, algorithm=self.digest_algorithm)
        if self.async_save and not sync:
            response = dcp.async_save(
                state,
                storage_writer=writer,
                planner=self._planner,
                process_group=self._pg,
                async_stager=self._the_stager(),
                no_dist=not self._distributed,
            )
            assert isinstance(response, AsyncSaveResponse)  # a stager that stages async
            done: Future[CheckpointCommitted | None] = Future()
            response.upload_completion.add_done_callback(
                lambda upload: self._commit_after(upload, done, path, manifest, writer)
            )
            self._inflight = _InFlight((step, attempt, path), response.staging_completion, done)
        else:
            dcp.save(
                state,
                storage_writer=writer,
                planner=self._planner,
                process_group=self._pg,
                no_dist=not self._distributed,
            )
            committed = self._commit(path, manifest, writer)
            if committed is not None:
                self._pending.append(committed)
        self._last_saved = (step, attempt)
        return time.perf_counter() - started

    def _the_stager(self) -> DefaultStager:
        if self._stager is None:
            device = torch.accelerator.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=device,
                    use_shared_memory=False,  # for DCP's checkpoint process, not used
                    use_async_staging=True,
                    use_non_blocking_copy=device,
                )
            )
        return self._stager

    def _commit(
        self, path: Path, manifest: Manifest, writer: DigestingWriter
    ) -> CheckpointCommitted | None:
        """Step 3 of the commit protocol (`elastrain.checkpoints.commit`), on rank 0."""
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

    def _commit_after(
        self,
        upload: Future[Any],
        done: Future[CheckpointCommitted | None],
        path: Path,
        manifest: Manifest,
        writer: DigestingWriter,
    ) -> None:
        """Runs in DCP's upload thread once the write is over: commit, or pass its error on."""
        try:
            upload.result()
            done.set_result(self._commit(path, manifest, writer))
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            done.set_exception(e)

    def wait_staged(self) -> float:
        """Block until the in-flight async save's staging copy is made; from then on the
        saved tensors may change. Returns the seconds waited. Raises CheckpointSaveError
        here, in the caller, when the copy failed: this rank then stops as it would on a
        failed synchronous save, rather than train on while its peers wait in the save's
        collectives for a write that will never start."""
        inflight = self._inflight
        if inflight is None or inflight.staged is None:
            return 0.0
        staged, inflight.staged = inflight.staged, None
        started = time.perf_counter()
        try:
            staged.result()
        except BaseException as e:
            raise CheckpointSaveError(*inflight.ident, e) from e
        return time.perf_counter() - started

    def _wait_inflight(self) -> None:
        """Block until the in-flight async save (if any) is done; raise if it failed."""
        if self._inflight is not None:
            self._collect(block=True)

    def _collect(self, *, block: bool) -> None:
        inflight = self._inflight
        if inflight is None or (not block and not inflight.done.done()):
            return
        self._inflight = None  # the write is over, so is its staging
        try:
            result = inflight.done.result()
        except BaseException as e:
            raise CheckpointSaveError(*inflight.ident, e) from e
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
        """finalize() and release the stager's buffers and DCP's cached plans."""
        try:
            return self.finalize()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            forget_cached_plans(self._planner._cached_plans_key)

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
                expected=info.manifest.files,
                process_group=self._pg,
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


def forget_cached_plans(key: str) -> None:
    """Drop what DCP's plan cache holds under `key` (class-level dicts on SavePlanner)."""
    for name in dir(SavePlanner):
        cache = getattr(SavePlanner, name)
        if name.startswith("_cached_") and isinstance(cache, dict):
            cache.pop(key, None)
