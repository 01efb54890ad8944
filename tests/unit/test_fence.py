"""The attempt fence on shared storage: a superseded attempt (a partitioned zombie) stops
training, never commits a checkpoint, and what it committed in the race is not resumed."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from elastrain.checkpoints.catalog import find_latest_good, list_committed
from elastrain.checkpoints.fence import (
    Fence,
    FenceUnreadable,
    FenceWatcher,
    Superseded,
    advance_fence,
    fence_path,
    read_fence,
)
from elastrain.checkpoints.layout import step_dir
from elastrain.checkpoints.manifest import Manifest, write_manifest


def test_the_fence_only_moves_forward(tmp_path: Path) -> None:
    assert read_fence(tmp_path) == Fence()
    advance_fence(tmp_path, 1, 100.0)
    advance_fence(tmp_path, 3, 200.0)
    assert advance_fence(tmp_path, 2, 300.0).current == 3  # never backwards
    fence = read_fence(tmp_path)
    assert fence.starts == ((1, 100.0), (3, 200.0))
    assert fence.superseded(2) and not fence.superseded(3)
    assert fence.replaced_at(1) == 200.0 and fence.replaced_at(3) is None
    assert fence.committed_by_zombie(1, 250.0) and not fence.committed_by_zombie(1, 150.0)


@contextmanager
def unprivileged() -> Iterator[None]:
    """Act as a user without root's right to read every file (root runs CI). Only the
    fence is read meanwhile: modules outside the test's reach may not be importable."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)  # nobody
    try:
        yield
    finally:
        os.seteuid(0)


def _no_right_to_read(path: Path) -> None:
    path.write_text('{"starts": [[1, 100.0]]}')
    path.chmod(0)


@pytest.mark.parametrize(
    ("case", "make", "fence"),
    [
        ("missing", lambda p: None, Fence()),
        ("valid", lambda p: p.write_text('{"starts": [[1, 100.0], [3, 200.0]]}'),
         Fence(starts=((1, 100.0), (3, 200.0)))),
        ("none started yet", lambda p: p.write_text('{"starts": []}'), Fence()),
        ("torn", lambda p: p.write_text('{"starts": [[1, '), FenceUnreadable),
        ("empty", lambda p: p.write_bytes(b""), FenceUnreadable),
        ("garbage bytes", lambda p: p.write_bytes(b"\x00\xff\xfe garbage"), FenceUnreadable),
        ("not an object", lambda p: p.write_text("[[1, 100.0]]"), FenceUnreadable),
        ("no starts", lambda p: p.write_text('{"attempts": [1]}'), FenceUnreadable),
        ("starts not pairs", lambda p: p.write_text('{"starts": [[1]]}'), FenceUnreadable),
        ("start not a number", lambda p: p.write_text('{"starts": [["one", 1.0]]}'),
         FenceUnreadable),
        ("a folder in its place", lambda p: p.mkdir(), FenceUnreadable),
        ("permission denied", _no_right_to_read, FenceUnreadable),
    ],
)  # fmt: skip
def test_an_unreadable_fence_stops_readers_a_missing_one_does_not(
    case: str, make: Any, fence: Any
) -> None:
    # A job folder anyone may reach (pytest's are root's alone), so that without root's
    # rights only the fence itself is in question.
    with tempfile.TemporaryDirectory() as folder:
        job = Path(folder)
        job.chmod(0o755)
        make(fence_path(job))
        with unprivileged() if case == "permission denied" else contextlib.nullcontext():
            if fence is FenceUnreadable:
                with pytest.raises(FenceUnreadable, match="cannot read the attempt fence"):
                    read_fence(job)
            else:
                assert read_fence(job) == fence


def test_a_watcher_that_cannot_read_the_fence_stops(tmp_path: Path) -> None:
    watcher = FenceWatcher(tmp_path, attempt=1)
    advance_fence(tmp_path, 1, 1.0)
    watcher.check()
    fence_path(tmp_path).write_text('{"starts": [[1, 1.0], [2, ')  # torn
    for _ in range(2):  # and again, if asked again: it never reads as the old fence
        with pytest.raises(FenceUnreadable):
            watcher.check()


def test_the_control_plane_replaces_an_unreadable_fence(tmp_path: Path) -> None:
    """It knows which attempt is current: every older one stays fenced out."""
    fence_path(tmp_path).write_bytes(b"\x00garbage")
    fence = advance_fence(tmp_path, 4, 400.0)
    assert fence == read_fence(tmp_path) == Fence(starts=((4, 400.0),))
    assert fence.superseded(3) and not fence.superseded(4)


def test_the_watcher_raises_once_a_newer_attempt_starts(tmp_path: Path) -> None:
    watcher = FenceWatcher(tmp_path, attempt=1)
    watcher.check()  # no fence yet
    advance_fence(tmp_path, 1, 1.0)
    watcher.check()
    advance_fence(tmp_path, 2, 2.0)
    with pytest.raises(Superseded, match="attempt 1 was superseded by attempt 2"):
        watcher.check()


def _commit(root: Path, step: int, attempt: int, created_at: float) -> Path:
    path = step_dir(root, step, attempt)
    path.mkdir(parents=True)
    write_manifest(path, Manifest(step=step, attempt=attempt, world_size=1, created_at=created_at))
    return path


def test_a_zombie_checkpoint_is_not_resumed_from(tmp_path: Path) -> None:
    job, root = tmp_path, tmp_path / "checkpoints"
    advance_fence(job, 1, 100.0)
    _commit(root, 10, 1, created_at=150.0)  # before attempt 2 started: good
    advance_fence(job, 2, 200.0)
    zombie = _commit(root, 30, 1, created_at=250.0)  # attempt 1 after it was replaced
    _commit(root, 20, 2, created_at=260.0)
    assert [(c.step, c.attempt) for c in list_committed(root)] == [(20, 2), (10, 1)]
    # (These folders hold no shards, so the others fail verification: only the reasons
    # matter here.)
    _, skipped = find_latest_good(root, digest_here=lambda _name: False)
    reasons = dict(skipped)
    assert "partitioned zombie" in reasons[str(zombie)]
    assert all("zombie" not in why for path, why in skipped if path != str(zombie))


def test_a_superseded_attempt_cannot_commit(tmp_path: Path) -> None:
    import torch

    from elastrain.checkpoints.dcp import CheckpointSaveError, ShardedCheckpointer

    job, root = tmp_path, tmp_path / "checkpoints"
    advance_fence(job, 2, 1.0)
    saver = ShardedCheckpointer(root, rank=0, world_size=1, async_save=False)
    state: dict[str, Any] = {"w": torch.zeros(4)}
    with pytest.raises(Superseded):
        saver.save(step=5, attempt=1, state=state, manifest_fields={})
    assert list_committed(root) == []
    asynchronous = ShardedCheckpointer(root, rank=0, world_size=1, async_save=True)
    asynchronous.save(step=6, attempt=1, state=state, manifest_fields={})
    with pytest.raises(CheckpointSaveError):
        asynchronous.close()
    assert list_committed(root) == []
    assert json.loads(fence_path(job).read_text())["starts"] == [[2, 1.0]]


def test_no_checkpoint_is_committed_behind_an_unreadable_fence(tmp_path: Path) -> None:
    import torch

    from elastrain.checkpoints.dcp import ShardedCheckpointer

    job, root = tmp_path, tmp_path / "checkpoints"
    fence_path(job).write_text('{"starts": [[1, 1.0]')  # torn
    saver = ShardedCheckpointer(root, rank=0, world_size=1, async_save=False)
    with pytest.raises(FenceUnreadable):
        saver.save(step=5, attempt=1, state={"w": torch.zeros(4)}, manifest_fields={})
    advance_fence(job, 1, 1.0)  # the control plane rewrites it: the catalogue reads again
    assert list_committed(root) == []


def superseded_mid_run(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Train attempt 1; as its 3rd step is reported, attempt 2 is launched elsewhere."""
    import time

    import torch

    from elastrain.contracts.spec import JobSpec
    from elastrain.workers.api import AttemptAborted, TrainContext
    from elastrain.workers.loop import train
    from tests.unit.hooks import RecordingHooks

    job = Path(root)
    advance_fence(job, 1, time.time())

    class Hooks(RecordingHooks):
        def send(self, message: Any) -> None:
            super().send(message)
            if getattr(message, "step", None) == 3 and len(self.metrics) == 3:
                advance_fence(job, 2, time.time())

    spec = JobSpec.model_validate(
        {"name": "z", "workload": {"name": "synthetic", "params": {"num_samples": 64}},
         "training": {"global_batch_size": 8, "micro_batch_size": 4, "max_steps": 50},
         "checkpoint": {"every_steps": 2, "async_save": False}}
    )  # fmt: skip
    ctx = TrainContext(
        rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"),
        job_id=1, attempt=1, checkpoint_root=job / "checkpoints", log_path=job / "rank0.log",
    )  # fmt: skip
    hooks = Hooks()
    try:
        train(ctx, spec, hooks)
    except AttemptAborted as exc:
        return {"aborted": str(exc), "steps": [m.step for m in hooks.metrics]}
    return {"aborted": None, "steps": [m.step for m in hooks.metrics]}


def test_a_superseded_attempt_stops_at_its_next_step_and_says_why(tmp_path: Path) -> None:
    from tests.unit.dist_utils import run_distributed

    [out] = run_distributed(superseded_mid_run, 1, str(tmp_path))
    assert out["aborted"] == "attempt 1 was superseded by attempt 2"
    assert out["steps"] == [1, 2, 3]  # not one step more
    assert "superseded by attempt 2: stopping at step 3" in (tmp_path / "rank0.log").read_text()
    assert [c.step for c in list_committed(tmp_path / "checkpoints")] == [2]


def test_a_rank_whose_collective_broke_behind_the_fence_was_superseded_not_failed(
    tmp_path: Path,
) -> None:
    """Its peer read the fence a step earlier and stopped, so its own collective broke:
    what it reports is the newer attempt, not the broken collective. Without a newer
    attempt the error is the error."""
    from types import SimpleNamespace

    from elastrain.checkpoints.fence import FenceWatcher
    from elastrain.workers.api import AttemptAborted
    from elastrain.workers.loop import stops_when_superseded

    ctx: Any = SimpleNamespace(step=7)
    advance_fence(tmp_path, 1, 1.0)
    fence = FenceWatcher(tmp_path, 1)
    with (
        pytest.raises(RuntimeError, match="Connection closed by peer"),
        stops_when_superseded(ctx, fence),
    ):
        raise RuntimeError("Connection closed by peer")
    advance_fence(tmp_path, 2, 2.0)
    with (
        pytest.raises(AttemptAborted, match="attempt 1 was superseded by attempt 2"),
        stops_when_superseded(ctx, fence),
    ):
        raise RuntimeError("Connection closed by peer")
