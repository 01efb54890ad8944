"""A job's folder belongs to one database, the one its fence names (`elastrain.checkpoints.fence`,
`Fence.owner`): another database's job of the same id never resumes from it, and that
database's workers write nothing more once it is claimed."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastrain.checkpoints.fence import (
    FenceWatcher,
    Superseded,
    advance_fence,
    claim_job_folder,
    read_fence,
)


def make_job(root: Path, owner: str, attempt: int = 1) -> Path:
    job = root / "jobs" / "1"
    (job / "checkpoints" / "step_10-a1").mkdir(parents=True)
    advance_fence(job, attempt, 1.0, owner=owner)
    return job


def test_a_new_folder_is_left_to_the_fence(tmp_path: Path) -> None:
    job = tmp_path / "jobs" / "1"
    assert claim_job_folder(job, "db") is None
    advance_fence(job, 1, 1.0, owner="db")
    assert read_fence(job).owner == "db"


def test_its_own_folder_is_kept(tmp_path: Path) -> None:
    job = make_job(tmp_path, "db")
    assert claim_job_folder(job, "db") is None
    assert (job / "checkpoints" / "step_10-a1").is_dir()


def test_a_fence_from_before_owners_is_taken_as_it_is(tmp_path: Path) -> None:
    job = make_job(tmp_path, "")
    assert claim_job_folder(job, "db") is None
    advance_fence(job, 1, 2.0, owner="db")
    assert read_fence(job).owner == "db" and read_fence(job).current == 1
    assert (job / "checkpoints" / "step_10-a1").is_dir()


def test_another_databases_folder_is_moved_aside_not_deleted(tmp_path: Path) -> None:
    job = make_job(tmp_path, "old", attempt=5)
    moved = claim_job_folder(job, "new")
    assert moved == tmp_path / "jobs" / "1.database-old"
    assert (moved / "checkpoints" / "step_10-a1").is_dir()  # that database's data, kept
    assert not job.exists()  # nothing to resume from
    fence = advance_fence(job, 1, 2.0, owner="new")  # the new job's attempt 1 is current
    assert fence.current == 1 and not fence.superseded(1, "new")
    # the same happening again (a third database) keeps both
    again = claim_job_folder(job, "third")
    assert again is not None and again != moved and moved.is_dir()


def test_the_old_databases_workers_are_superseded_whatever_their_attempt(
    tmp_path: Path,
) -> None:
    """A zombie of the old database's attempt 5 still running when the folder is claimed:
    the new owner's fence (at attempt 1) stops it, as it stops its commit."""
    job = make_job(tmp_path, "old", attempt=5)
    zombie = FenceWatcher(job, 5, owner="old")
    zombie.check()
    claim_job_folder(job, "new")
    advance_fence(job, 1, 2.0, owner="new")
    with pytest.raises(Superseded):
        zombie.check()
    assert read_fence(job).superseded(5, "old")
    assert not read_fence(job).superseded(1, "new")
    assert not read_fence(job).superseded(1)  # a writer that names no owner: by attempt
