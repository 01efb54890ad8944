"""The pure-Python half of `checkpoints`: layout, manifest, integrity, catalogue, retention.

Checkpoints here are fake (small files shaped like a DCP folder) so the tests are fast; the
real DCP round trips are in test_checkpoints_dcp.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastrain.checkpoints.catalog import find_latest_good, list_committed, scan
from elastrain.checkpoints.integrity import CorruptCheckpoint, describe_files, digest_file, verify
from elastrain.checkpoints.layout import (
    StepDir,
    iter_step_dirs,
    parse_step_dir_name,
    rank_extra_name,
    step_dir,
    step_dir_name,
)
from elastrain.checkpoints.manifest import (
    Manifest,
    ManifestError,
    ManifestMissing,
    read_manifest,
    write_manifest,
)
from elastrain.checkpoints.retention import (
    delete_checkpoints,
    plan_retention,
    retention_plan,
)


def make_checkpoint(
    root: Path, step: int, attempt: int = 0, *, commit: bool = True, world_size: int = 2
) -> Path:
    """A fake checkpoint: two shards, `.metadata`, one rank extra; manifest if `commit`."""
    path = step_dir(root, step, attempt)
    path.mkdir(parents=True)
    for rank in range(world_size):
        (path / f"__{rank}_0.distcp").write_bytes(bytes([step % 256, rank]) * 1000)
    (path / ".metadata").write_bytes(b"meta" * 10)
    (path / rank_extra_name(0)).write_bytes(b"rng")
    if commit:
        files = describe_files(path)
        write_manifest(
            path,
            Manifest(
                step=step,
                attempt=attempt,
                world_size=world_size,
                strategy="ddp",
                layout={"dp": world_size, "pp": 1},
                data_position={"step": step, "samples_consumed": step * 8},
                extra={"seed": 1},
                files=files,
                total_bytes=sum(f["size"] for f in files.values()),
            ),
        )
    return path


# -- layout -----------------------------------------------------------------------------


def test_step_dir_names_round_trip() -> None:
    assert step_dir_name(42, 3) == "step_000000042-a3"
    assert parse_step_dir_name("step_000000042-a3") == (42, 3)
    assert parse_step_dir_name(step_dir_name(10**10, 0)) == (10**10, 0)  # > 9 digits
    for junk in ("step_42-a3", "step_000000042", "step_000000042-a", "x", "step_000000042-a3x"):
        assert parse_step_dir_name(junk) is None
    assert rank_extra_name(7) == "rank_7.extra.pt"
    with pytest.raises(ValueError):
        step_dir_name(-1, 0)


def test_iter_step_dirs_ignores_junk_and_sorts(tmp_path: Path) -> None:
    assert iter_step_dirs(tmp_path / "missing") == []
    for name in ("step_000000002-a0", "step_000000010-a0", "step_000000002-a1", "notes"):
        (tmp_path / name).mkdir()
    (tmp_path / "step_000000099-a0").write_text("a file, not a folder")
    found = [(d.step, d.attempt) for d in iter_step_dirs(tmp_path)]
    assert found == [(10, 0), (2, 1), (2, 0)]


# -- manifest ---------------------------------------------------------------------------


def test_manifest_round_trip(tmp_path: Path) -> None:
    m = Manifest(
        step=5,
        attempt=2,
        world_size=3,
        strategy="fsdp",
        layout={"dp": 3, "pp": 1},
        data_position={"step": 5, "samples_consumed": 40},
        extra={"seed": 7, "global_batch": 8},
        files={".metadata": {"size": 3, "digest": "ab", "algorithm": "xxh3-128"}},
        total_bytes=3,
        created_at=1234.5,
    )
    write_manifest(tmp_path, m)
    assert read_manifest(tmp_path) == m
    assert json.loads((tmp_path / "manifest.json").read_text())["format_version"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no tmp left behind


def test_read_manifest_errors(tmp_path: Path) -> None:
    with pytest.raises(ManifestMissing):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="unparseable"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 1, "step": -1}))
    with pytest.raises(ManifestError, match="step"):
        read_manifest(tmp_path)
    good = Manifest(step=1, attempt=0, world_size=1).to_dict()
    good["files"] = {"../escape": {"size": 1, "digest": "x", "algorithm": "sha256"}}
    (tmp_path / "manifest.json").write_text(json.dumps(good))
    with pytest.raises(ManifestError, match="escapes"):
        read_manifest(tmp_path)


def test_manifest_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash in the middle of writing the manifest leaves the previous state (no manifest
    at all here), never a partial manifest."""
    write_manifest(tmp_path, Manifest(step=1, attempt=0, world_size=1))
    before = (tmp_path / "manifest.json").read_bytes()

    def crash(*_args: object) -> None:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        write_manifest(tmp_path, Manifest(step=2, attempt=0, world_size=1))
    assert (tmp_path / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


# -- integrity ---------------------------------------------------------------------------


def test_digest_file_streams(tmp_path: Path) -> None:
    import hashlib

    import xxhash

    data = os.urandom(9 * 1024 * 1024 + 17)  # more than one chunk, not a multiple
    (tmp_path / "f").write_bytes(data)
    assert digest_file(tmp_path / "f") == xxhash.xxh3_128(data).hexdigest()  # the default
    assert digest_file(tmp_path / "f", "sha256") == hashlib.sha256(data).hexdigest()


def test_verify_names_the_problem(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, 1)
    assert verify(path).step == 1

    shard = path / "__1_0.distcp"
    original = shard.read_bytes()
    shard.write_bytes(original[:-10])
    with pytest.raises(CorruptCheckpoint, match=r"truncated: __1_0\.distcp"):
        verify(path)
    # Sizes only: cheap check still catches truncation.
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        verify(path, digests_of=())

    flipped = bytearray(original)
    flipped[100] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    verify(path, digests_of=())  # same size: only the digest sees it
    with pytest.raises(CorruptCheckpoint, match=r"digest mismatch: __1_0\.distcp"):
        verify(path)

    shard.unlink()
    with pytest.raises(CorruptCheckpoint, match=r"missing file __1_0\.distcp"):
        verify(path)

    (path / "manifest.json").unlink()
    with pytest.raises(CorruptCheckpoint, match=r"no manifest\.json"):
        verify(path)


def test_verify_requires_dcp_metadata_and_matching_name(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, 1)
    m = read_manifest(path)
    del m.files[".metadata"]
    with pytest.raises(CorruptCheckpoint, match=r"\.metadata"):
        verify(path, m)
    renamed = tmp_path / step_dir_name(2, 0)
    path.rename(renamed)
    with pytest.raises(CorruptCheckpoint, match="folder name says step 2"):
        verify(renamed)


# -- catalogue --------------------------------------------------------------------------


def test_list_committed_ignores_torn_and_junk(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 3, commit=False)  # crashed between shards and manifest
    (tmp_path / "junk").mkdir()
    (tmp_path / "stray.txt").write_text("x")
    bad = make_checkpoint(tmp_path, 4, commit=False)
    (bad / "manifest.json").write_text("{torn")
    infos = list_committed(tmp_path)
    assert [(i.step, i.attempt) for i in infos] == [(2, 0), (1, 0)]
    assert infos[0].world_size == 2 and infos[0].total_bytes > 4000
    assert infos[0].manifest.data_position == {"step": 2, "samples_consumed": 16}
    s = scan(tmp_path)
    assert [d.step for d in s.uncommitted] == [3]
    assert [d.step for d, _ in s.unreadable] == [4]


def test_newer_attempt_wins_for_same_step(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 5, attempt=1)
    make_checkpoint(tmp_path, 5, attempt=2)
    info, skipped = find_latest_good(tmp_path)
    assert info is not None and (info.step, info.attempt) == (5, 2)
    assert skipped == []


def test_find_latest_good_falls_back_with_reasons(tmp_path: Path) -> None:
    assert find_latest_good(tmp_path) == (None, [])
    make_checkpoint(tmp_path, 1)
    p2 = make_checkpoint(tmp_path, 2)
    p3 = make_checkpoint(tmp_path, 3)
    p4 = make_checkpoint(tmp_path, 4, commit=False)
    shard = p3 / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[5] ^= 1
    shard.write_bytes(bytes(data))
    (p2 / "__1_0.distcp").write_bytes(b"short")

    info, skipped = find_latest_good(tmp_path)
    assert info is not None and info.step == 1
    reasons = dict(skipped)
    assert list(reasons) == [str(p4), str(p3), str(p2)]
    assert "uncommitted" in reasons[str(p4)]
    assert "digest mismatch" in reasons[str(p3)]
    assert "truncated" in reasons[str(p2)]

    # Without digests the flipped byte goes unnoticed (documented trade-off).
    info, _ = find_latest_good(tmp_path, digest_here=lambda _name: False)
    assert info is not None and info.step == 3


def test_crash_between_shards_and_manifest_leaves_nothing_pickable(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 7, commit=False)
    assert list_committed(tmp_path) == []
    info, skipped = find_latest_good(tmp_path)
    assert info is None and len(skipped) == 1


# -- retention --------------------------------------------------------------------------


def test_plan_retention_keeps_last_k_and_newest(tmp_path: Path) -> None:
    for step in range(1, 6):
        make_checkpoint(tmp_path, step)
    infos = list_committed(tmp_path)
    plan = plan_retention(infos, keep_last=2)
    assert [parse_step_dir_name(p.name) for p in plan] == [(1, 0), (2, 0), (3, 0)]
    with pytest.raises(ValueError):
        plan_retention(infos, keep_last=1)
    # Fewer than K: nothing to delete; the newest is never deleted.
    assert plan_retention(infos[:1], keep_last=3) == []
    assert all(infos[0].path not in plan_retention(infos, k) for k in (2, 3, 4, 9))


def test_plan_retention_garbage_only_older_than_newest_committed(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4, attempt=1)
    old_torn = StepDir(path=tmp_path / step_dir_name(3, 0), step=3, attempt=0)
    newer_in_progress = StepDir(path=tmp_path / step_dir_name(5, 0), step=5, attempt=0)
    same_step_older_attempt = StepDir(path=tmp_path / step_dir_name(4, 0), step=4, attempt=0)
    plan = plan_retention(
        list_committed(tmp_path),
        keep_last=2,
        uncommitted=[old_torn, newer_in_progress, same_step_older_attempt],
    )
    assert plan == [old_torn.path, same_step_older_attempt.path]


def test_retention_deletes_and_tolerates_missing(tmp_path: Path) -> None:
    for step in range(1, 5):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 2, attempt=9, commit=False)  # garbage from a crashed save
    make_checkpoint(tmp_path, 6, commit=False)  # maybe in progress: kept
    (step_dir(tmp_path, 1, 0) / "__0_0.distcp").unlink()  # already partly gone

    doomed = retention_plan(tmp_path, keep_last=2)
    assert [parse_step_dir_name(p.name) for p in doomed] == [(1, 0), (2, 0), (2, 9)]
    delete_checkpoints(tmp_path, doomed)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [step_dir_name(3, 0), step_dir_name(4, 0), step_dir_name(6, 0)]
    assert retention_plan(tmp_path, keep_last=2) == []  # nothing more to delete
    delete_checkpoints(tmp_path, doomed)  # deleted already: not an error
    delete_checkpoints(tmp_path, [tmp_path / "never-existed"])  # not an error


def test_half_deleted_checkpoint_is_not_committed(tmp_path: Path) -> None:
    """Deletion removes the manifest first: interrupt it after that and the folder is
    garbage, not a committed checkpoint with missing shards."""
    make_checkpoint(tmp_path, 1)
    p2 = make_checkpoint(tmp_path, 2)
    (p2 / "manifest.json").unlink()  # what delete_checkpoints does first
    (p2 / "__0_0.distcp").unlink()
    info, _ = find_latest_good(tmp_path)
    assert info is not None and info.step == 1


def test_pure_modules_do_not_import_torch() -> None:
    code = (
        "import sys, checkpoints, elastrain.checkpoints.catalog, elastrain.checkpoints.retention, "
        "elastrain.checkpoints.integrity, elastrain.checkpoints.layout, elastrain.checkpoints.manifest; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
