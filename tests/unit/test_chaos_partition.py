"""The chaos campaign's partition kind (bench/chaos_bench.py): which kinds each kind of
cluster can inject, and how a cut-off attempt that trained on as a second group is found
(the checkpoints it committed after it was replaced)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos_bench import (
    KINDS,
    LO_ONLY,
    NETNS_ONLY,
    default_kinds,
    lingering,
    process_name,
    unavailable_kinds,
    zombie_commits,
)
from elastrain.checkpoints.fence import advance_fence, fence_path
from elastrain.checkpoints.layout import step_dir
from elastrain.checkpoints.manifest import Manifest, write_manifest


@pytest.mark.parametrize(
    ("kinds", "netns", "unavailable"),
    [
        (["partition"], False, ["partition"]),
        (["partition"], True, []),
        (["collective_hang"], True, ["collective_hang"]),
        (["collective_hang"], False, []),
        (["kill9", "node_removed", "raylet_kill", "freeze"], True, []),
        (["kill9", "node_removed", "raylet_kill", "freeze"], False, []),
        (["collective_hang", "kill9", "partition"], False, ["partition"]),
        (["partition", "kill9", "collective_hang"], True, ["collective_hang"]),
        ([], True, []),
    ],
)  # fmt: skip
def test_each_cluster_injects_its_own_kinds(
    kinds: list[str], netns: bool, unavailable: list[str]
) -> None:
    assert unavailable_kinds(kinds, netns) == unavailable


@pytest.mark.parametrize(
    ("netns", "left_out"), [(False, {"partition"}), (True, {"collective_hang"})]
)
def test_without_kinds_a_campaign_injects_all_its_cluster_can(
    netns: bool, left_out: set[str]
) -> None:
    assert default_kinds(netns) == [k for k in KINDS if k not in left_out]


def test_no_kind_is_left_out_of_both_clusters() -> None:
    assert not NETNS_ONLY & LO_ONLY
    assert set(KINDS) >= (NETNS_ONLY | LO_ONLY)


def _committed(job_root: Path, step: int, attempt: int, created_at: float) -> Path:
    path = step_dir(job_root / "checkpoints", step, attempt)
    path.mkdir(parents=True)
    write_manifest(path, Manifest(step=step, attempt=attempt, world_size=1, created_at=created_at))
    return path


def _uncommitted(job_root: Path, step: int, attempt: int) -> Path:
    path = step_dir(job_root / "checkpoints", step, attempt)
    path.mkdir(parents=True)
    return path


# Attempt 1 started at 100, attempt 2 (the one after the partition) at 200.
@pytest.mark.parametrize(
    ("case", "checkpoints", "attempt", "zombie"),
    [
        ("committed before it was replaced", [(25, 1, 150.0)], 1, []),
        ("committed after it was replaced", [(25, 1, 150.0), (50, 1, 250.0)], 1, [(50, 1)]),
        ("the newer attempt's own commits", [(50, 2, 250.0)], 1, []),
        ("a save never committed", [(50, 1, None)], 1, []),
        ("the newest attempt is never a zombie", [(75, 2, 300.0)], 2, []),
        ("nothing saved", [], 1, []),
    ],
)  # fmt: skip
def test_a_cut_off_attempt_that_saved_after_it_was_replaced_is_found(
    tmp_path: Path,
    case: str,
    checkpoints: list[tuple[int, int, float | None]],
    attempt: int,
    zombie: list[tuple[int, int]],
) -> None:
    advance_fence(tmp_path, 1, 100.0)
    advance_fence(tmp_path, 2, 200.0)
    for step, of_attempt, created_at in checkpoints:
        if created_at is None:
            _uncommitted(tmp_path, step, of_attempt)
        else:
            _committed(tmp_path, step, of_attempt, created_at)
    expected = [step_dir(tmp_path / "checkpoints", s, a) for s, a in zombie]
    assert zombie_commits(tmp_path, attempt) == expected, case


def test_an_unreadable_fence_tells_nothing_either_way(tmp_path: Path) -> None:
    """A fence that cannot be read (torn) is neither "no zombie" nor a zombie: unknown."""
    _committed(tmp_path, 50, 1, 250.0)
    fence_path(tmp_path).write_text('{"starts": [[1, ')
    assert zombie_commits(tmp_path, 1) is None


PY = "/work/main/.venv/bin/python"
RAY = "/work/main/.venv/lib/python3.11/site-packages/ray"


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        ([f"{RAY}/core/src/ray/raylet/raylet", "--raylet_socket_name=x", ""], "raylet"),
        (["ray::WorkerProcess.run   ", "", ""], "ray::WorkerProcess.run"),
        (["ray::DashboardAgent"], "ray::DashboardAgent"),
        ([PY, "-u", f"{RAY}/_private/log_monitor.py", "--session-dir=/tmp/x"], "log_monitor.py"),
        ([PY, "/work/main/.venv/bin/ray", "start", "--address=10.1.2.1:6379"], "ray"),
        ([PY], "python"),
        (["", ""], "?"),
        ([], "?"),
    ],
)  # fmt: skip
def test_a_node_process_is_named_by_what_it_runs(argv: list[str], name: str) -> None:
    assert process_name(argv) == name


@pytest.mark.parametrize(
    ("names", "waited_for"),
    [
        ({1: "raylet", 2: "log_monitor.py", 3: "ray::WorkerProcess.run"}, [1, 3]),
        ({2: "log_monitor.py"}, []),
        ({7: "ray::RuntimeEnvAgent", 5: "ray::DashboardAgent"}, [5, 7]),
        ({}, []),
    ],
)  # fmt: skip
def test_after_a_heal_all_but_the_log_monitor_should_go(
    names: dict[int, str], waited_for: list[int]
) -> None:
    assert lingering(names) == waited_for
