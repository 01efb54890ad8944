"""Sharded save/load with torch.distributed.checkpoint (DCP). Saves are DCP's `save` /
`async_save` with its `DefaultStager` and plan-caching save planner; ours are the writer
that digests shards as written (`writer`) and the commit on rank 0 (fence, manifest last:
`elastrain.checkpoints.catalog`). The caller must call `wait_staged()` before mutating the
saved tensors in place (before the optimizer step), so no later update leaks in.

The upload runs in DCP's thread, not its checkpoint process: that process keeps the
process group of the world size it was made at, which an elastic job's warm process
outlives (docs/bench-checkpoint.md, "Thread or process": no slower).

Loads are DCP's own; every shard's digest is verified by the rank reading it before any
byte reaches the state (`reader`), and a corrupt shard makes every rank fall back.
"""

from __future__ import annotations

import io
import itertools
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
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

from elastrain.checkpoints.catalog import LoadOutcome, commit, find_latest_good, manifest_for
from elastrain.checkpoints.confined import atomic_write_bytes
from elastrain.checkpoints.dcp.reader import VerifyingReader
from elastrain.checkpoints.dcp.writer import SHARD_SUFFIX, DigestingWriter
from elastrain.checkpoints.integrity import CorruptCheckpoint
from elastrain.checkpoints.layout import MANIFEST_NAME, rank_extra_name, step_dir
from elastrain.checkpoints.manifest import DEFAULT_ALGORITHM, Manifest, algorithm_for_setting
from elastrain.contracts.messages import CheckpointCommitted

# DCP warns that a save without collectives assumes one process: a group of one does.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)

_planner_keys = itertools.count()


class CheckpointSaveError(RuntimeError):
    """A (usually background) save failed; nothing was committed for it."""

    def __init__(self, step: int, attempt: int, path: Path, cause: BaseException) -> None:
        super().__init__(
            f"checkpoint of step {step} (attempt {attempt}) at {path} failed: {cause!r}"
        )
        self.step, self.attempt, self.path = step, attempt, path


@dataclass
class _InFlight:
    ident: tuple[int, int, Path]
    staged: Future[None] | None
    done: Future[CheckpointCommitted | None]


class ShardedCheckpointer:
    """One per attempt on every rank (or a lone process): DCP's plan cache and the
    stager's buffers are this attempt's."""

    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        world_size: int,
        async_save: bool,
        owner: str = "",
        digest: str = DEFAULT_ALGORITHM,
    ) -> None:
        """Collective: it makes a gloo group of its own, so async saves run collectives
        from a background thread while training uses the default (maybe NCCL) group, out
        of the training group's sequence. `digest`: a `checkpoint.digest` setting or
        algorithm name for saves; `owner`: the job's database (the fence must name it)."""
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.async_save = async_save
        self.digest_algorithm = algorithm_for_setting(digest)
        self.owner = owner
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._distributed:
            self._pg: dist.ProcessGroup | None = dist.new_group(backend="gloo")
            self._coordinator = dist.get_rank(self._pg) == 0
        else:
            if world_size != 1:
                raise ValueError("world_size > 1 needs an initialised torch.distributed")
            self._pg = None
            self._coordinator = True
        # DCP caches plans per planner class, process-wide: a key of our own, so a warm
        # process's next attempt (another group or world size) never meets these.
        self._planner = DefaultSavePlanner(enable_plan_caching=True)
        self._planner._cached_plans_key = f"elastrain-{next(_planner_keys)}"
        self._stager: DefaultStager | None = None
        self._inflight: _InFlight | None = None
        self._pending: list[CheckpointCommitted] = []
        self._last_saved: tuple[int, int] | None = None

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
        """Save `state` as checkpoint (step, attempt), on every rank at the same step;
        returns the seconds the caller was blocked. `sync`: written now even when saves
        are async (an attempt's last save: its caller waits for the commit anyway)."""
        started = time.perf_counter()
        self._collect(block=True)
        if self._last_saved == (step, attempt):
            # E.g. CHECKPOINT then STOP at one step; every rank decides alike.
            return time.perf_counter() - started
        manifest = manifest_for(step, attempt, manifest_fields, world_size=self.world_size)
        path = step_dir(self.root, step, attempt)
        path.mkdir(parents=True, exist_ok=True)
        if self._coordinator:  # a half-overwritten committed folder must never count
            (path / MANIFEST_NAME).unlink(missing_ok=True)
        if rank_extra is not None:  # serialised now: this step's RNG states
            buf = io.BytesIO()
            torch.save(rank_extra, buf)
            atomic_write_bytes(path / rank_extra_name(self.rank), buf.getvalue())
        writer = DigestingWriter(path, algorithm=self.digest_algorithm)
        how: dict[str, Any] = {
            "storage_writer": writer,
            "planner": self._planner,
            "process_group": self._pg,
        }
        if self.async_save and not sync:
            response = dcp.async_save(
                state, **how, async_stager=self._the_stager(), no_dist=not self._distributed
            )
            assert isinstance(response, AsyncSaveResponse)  # a stager that stages async
            done: Future[CheckpointCommitted | None] = Future()

            def commit_once_written(upload: Future[Any]) -> None:  # in DCP's upload thread
                try:
                    upload.result()
                    done.set_result(self._commit(path, manifest, writer))
                except BaseException as e:  # DCP's CheckpointException is a BaseException
                    done.set_exception(e)

            response.upload_completion.add_done_callback(commit_once_written)
            self._inflight = _InFlight((step, attempt, path), response.staging_completion, done)
        else:
            dcp.save(state, **how, no_dist=not self._distributed)
            committed = self._commit(path, manifest, writer)
            self._pending += [committed] if committed is not None else []
        self._last_saved = (step, attempt)
        return time.perf_counter() - started

    def _the_stager(self) -> DefaultStager:
        """Made lazily: on a GPU its stream must come after training's (DCP's advice)."""
        if self._stager is None:
            device = torch.accelerator.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=device,
                    use_shared_memory=False,  # only for DCP's checkpoint process
                    use_non_blocking_copy=device,
                )
            )
        return self._stager

    def _commit(
        self, path: Path, manifest: Manifest, writer: DigestingWriter
    ) -> CheckpointCommitted | None:
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

    def wait_staged(self) -> float:
        """Wait for the in-flight save's staging copy (then the tensors may change);
        returns the seconds waited. A failed copy raises CheckpointSaveError here, so
        this rank stops rather than train on while its peers wait in the save's
        collectives for a write that never starts."""
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

    def _collect(self, *, block: bool) -> None:
        """Take the in-flight save's commit once done (`block`: wait); raise if it failed."""
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

    def poll_commits(self) -> list[CheckpointCommitted]:
        """Commits since the last call (rank 0; [] elsewhere), non-blocking. Raises
        CheckpointSaveError when a background save failed: never lost silently."""
        self._collect(block=False)
        out, self._pending = self._pending, []
        return out

    def finalize(self) -> list[CheckpointCommitted]:
        """Wait for the in-flight save; return the commits not yet polled."""
        self._collect(block=True)
        return self.poll_commits()

    def close(self) -> list[CheckpointCommitted]:
        """finalize() and release the stager's buffers and DCP's cached plans."""
        try:
            return self.finalize()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            forget_cached_plans(self._planner._cached_plans_key)

    def load_latest(self, state: dict[str, Any]) -> LoadOutcome | None:
        """Load the newest good checkpoint into `state` in place (DCP reshards), on every
        rank. Rank 0 chooses (names, sizes, non-shard digests) and broadcasts, so all load
        the same one; shards are verified by their readers before any byte reaches the
        state (`VerifyingReader`), and a corrupt one sends every rank to the next older
        checkpoint, `state` untouched. None when there is no good one."""
        self._collect(block=True)  # never read a folder we are still writing
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
                info.path, expected=info.manifest.files, process_group=self._pg
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
                # Every rank got the same verdicts: rank 0 picks again without this one.
                refused[str(info.path)] = corrupt
                continue
            break
        rank_extra = None
        extra_path = info.path / rank_extra_name(self.rank)
        if info.world_size == self.world_size and extra_path.is_file():
            # Our own file, digest-checked on rank 0; RNG states need weights_only=False.
            rank_extra = torch.load(extra_path, map_location="cpu", weights_only=False)
        return LoadOutcome(info=info, skipped=skipped, rank_extra=rank_extra)


def corrupt_shard_reason(error: BaseException) -> str | None:
    """The reason when a DCP load failed only because a `VerifyingReader` found a shard
    corrupt (on any rank), else None (a failure to raise, not to fall back on)."""
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
