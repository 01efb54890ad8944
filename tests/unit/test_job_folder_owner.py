"""A job's folder belongs to one database (`checkpoints.owner`): another database's job of
the same id never resumes from it."""

from __future__ import annotations

from pathlib import Path

from checkpoints.owner import OWNER_FILE, claim_job_folder


def make_job(root: Path, owner: str | None) -> Path:
    job = root / "jobs" / "1"
    (job / "checkpoints" / "step_10-a1").mkdir(parents=True)
    if owner is not None:
        (job / OWNER_FILE).write_text(owner)
    return job


def test_a_new_folder_is_made_and_marked(tmp_path: Path) -> None:
    job = tmp_path / "jobs" / "1"
    assert claim_job_folder(job, "db") is None
    assert (job / OWNER_FILE).read_text() == "db"


def test_its_own_folder_is_kept(tmp_path: Path) -> None:
    job = make_job(tmp_path, "db")
    assert claim_job_folder(job, "db") is None
    assert (job / "checkpoints" / "step_10-a1").is_dir()


def test_a_folder_from_before_marks_is_taken_as_it_is(tmp_path: Path) -> None:
    job = make_job(tmp_path, None)
    assert claim_job_folder(job, "db") is None
    assert (job / "checkpoints" / "step_10-a1").is_dir()
    assert (job / OWNER_FILE).read_text() == "db"


def test_another_databases_folder_is_moved_aside_not_deleted(tmp_path: Path) -> None:
    job = make_job(tmp_path, "old")
    moved = claim_job_folder(job, "new")
    assert moved == tmp_path / "jobs" / "1.database-old"
    assert (moved / "checkpoints" / "step_10-a1").is_dir()  # that database's data, kept
    assert sorted(p.name for p in job.iterdir()) == [OWNER_FILE]  # nothing to resume from
    assert (job / OWNER_FILE).read_text() == "new"
    # the same happening again (a third database) keeps both
    (job / OWNER_FILE).write_text("old")
    again = claim_job_folder(job, "third")
    assert again is not None and again != moved and moved.is_dir()
