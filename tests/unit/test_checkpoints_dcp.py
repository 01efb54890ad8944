"""ShardedCheckpointer with real DCP on gloo: resharding, async saves, commit protocol.

Each scenario saves once in a module-scoped fixture (spawned gloo processes) and several
tests load what it saved at other world sizes, so the number of process spawns stays small.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from elastrain.checkpoints.catalog import find_latest_good, list_committed
from elastrain.checkpoints.dcp import CheckpointSaveError, ShardedCheckpointer, checkpointer
from elastrain.checkpoints.manifest import read_manifest
from elastrain.checkpoints.retention import delete_checkpoints, retention_plan
from tests.unit.dist_utils import run_distributed

torch.set_num_threads(1)

FIELDS = {
    "strategy": "ddp",
    "layout": {"dp": 2, "pp": 1},
    "data_position": {"step": 3, "samples_consumed": 24},
    "extra": {"seed": 0, "global_batch": 8},
}


# -- model and state helpers (module level: spawned processes import them by name) -------


def build(strategy: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    distributed = dist.is_initialized()
    if strategy == "ddp" and distributed:
        model = DDP(model)
    elif strategy == "fsdp":
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    for i in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + i * 10 + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g)
        optim.zero_grad()
        F.mse_loss(model(x), y).backward()
        optim.step()


def ckpt_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Unsharded copy of model + optimizer state keyed by FQN, comparable across sizes."""
    model_sd, optim_sd = get_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=True)
    )

    def detach(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.full_tensor() if hasattr(x, "full_tensor") else x
            return x.detach().clone()
        if isinstance(x, dict):
            return {k: detach(v) for k, v in x.items()}
        if isinstance(x, list):
            return [detach(v) for v in x]
        return x

    return {"model": detach(model_sd), "optim": detach(optim_sd)}


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"tensor differs at {where}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"keys differ at {where}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"lengths differ at {where}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{a!r} != {b!r} at {where}"


def load_into_fresh(strategy: str, root: str, world_size: int) -> dict[str, Any]:
    """Build a fresh model at this world size, load the latest good checkpoint, return
    what was restored (full state, chosen step, skipped, rank extra)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    model, optim = build(strategy)
    ckpt = ShardedCheckpointer(Path(root), rank=rank, world_size=world_size, async_save=False)
    state = ckpt_state(model, optim)
    outcome = ckpt.load_latest(state)
    assert outcome is not None
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {
        "full": full_state(model, optim),
        "step": outcome.info.step,
        "skipped": outcome.skipped,
        "rank_extra": outcome.rank_extra,
    }


@contextmanager
def crash_before_manifest() -> Iterator[None]:
    """Saves die (raise) after every shard and `.metadata` are written, before the
    manifest: the commit (group rank 0's) fails."""

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("simulated crash before manifest")

    original = checkpointer.commit
    checkpointer.commit = crash
    try:
        yield
    finally:
        checkpointer.commit = original


# -- DDP: save at 2, reload at 2 (rank extras), 1 and 3 ---------------------------------


def _ddp_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, optim = build("ddp")
    ckpt = ShardedCheckpointer(Path(root), rank=rank, world_size=world_size, async_save=False)
    refs: dict[int, Any] = {}
    for step in (3, 5):
        train(model, optim, 3 if step == 3 else 2, seed=step)
        blocked = ckpt.save(
            step=step,
            attempt=1,
            state=ckpt_state(model, optim),
            manifest_fields=FIELDS,
            rank_extra={"rank": rank, "rng": torch.get_rng_state()},
        )
        assert blocked >= 0
        refs[step] = full_state(model, optim)
    commits = ckpt.finalize() + ckpt.poll_commits()
    # Saving the same (step, attempt) again is a no-op on every rank.
    ckpt.save(step=5, attempt=1, state=ckpt_state(model, optim), manifest_fields=FIELDS)

    # A crash between shards and manifest at step 7.
    train(model, optim, 2, seed=7)
    crashing = ShardedCheckpointer(Path(root), rank=rank, world_size=world_size, async_save=False)
    try:
        with crash_before_manifest():
            crashing.save(step=7, attempt=1, state=ckpt_state(model, optim), manifest_fields=FIELDS)
        crashed = False
    except RuntimeError:
        crashed = True
    assert crashed == (rank == 0)

    # Same world size: rank extras come back.
    again = load_into_fresh("ddp", root, world_size)
    assert again["step"] == 5
    assert again["rank_extra"]["rank"] == rank
    assert_same(again["full"], refs[5])
    return {"refs": refs, "commits": commits, "skipped": again["skipped"]}


@pytest.fixture(scope="module")
def ddp_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("ddp") / "ckpt"
    results = run_distributed(_ddp_save, 2, str(root), timeout_s=240)
    return root, results[0]


def test_ddp_commits_and_manifest(ddp_saved: tuple[Path, dict[str, Any]]) -> None:
    _root, saved = ddp_saved
    commits = saved["commits"]
    assert [(c.step, c.attempt, c.world_size) for c in commits] == [(3, 1, 2), (5, 1, 2)]
    assert all(c.bytes > 0 and Path(c.path).is_dir() for c in commits)
    m = read_manifest(commits[1].path)
    assert commits[1].manifest == m.to_dict()
    assert m.strategy == "ddp" and m.layout == {"dp": 2, "pp": 1}
    assert m.data_position == FIELDS["data_position"] and m.extra == FIELDS["extra"]
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rank_0.extra.pt"} <= set(m.files)
    assert m.total_bytes == sum(f["size"] for f in m.files.values())


def test_crash_before_manifest_leaves_nothing_pickable(
    ddp_saved: tuple[Path, dict[str, Any]],
) -> None:
    root, saved = ddp_saved
    torn = root / "step_000000007-a1"
    assert (torn / ".metadata").is_file()  # every shard was written...
    assert not (torn / "manifest.json").exists()  # ...but never committed
    assert [i.step for i in list_committed(root)] == [5, 3]
    assert saved["skipped"] == [(str(torn), "uncommitted: no manifest.json")]


def test_ddp_load_at_world_size_1_without_process_group(
    ddp_saved: tuple[Path, dict[str, Any]],
) -> None:
    root, saved = ddp_saved
    got = load_into_fresh("ddp", str(root), 1)
    assert got["step"] == 5
    assert got["rank_extra"] is None  # saved at 2 ranks: per-rank RNG means nothing at 1
    assert_same(got["full"], saved["refs"][5])


def test_corrupt_shard_falls_back_to_previous(
    ddp_saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, saved = ddp_saved
    copy = tmp_path / "ckpt"
    shutil.copytree(root, copy)
    shard = copy / "step_000000005-a1" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))

    got = load_into_fresh("ddp", str(copy), 1)
    assert got["step"] == 3
    assert_same(got["full"], saved["refs"][3])
    reasons = dict(got["skipped"])
    assert "digest mismatch: __1_0.distcp" in reasons[str(copy / "step_000000005-a1")]

    # Truncation is caught by the size check alone.
    shard.write_bytes(bytes(data[:-7]))
    info, skipped = find_latest_good(copy, digest_here=lambda _name: False)
    assert info is not None and info.step == 3
    assert "truncated" in dict(skipped)[str(copy / "step_000000005-a1")]


# -- FSDP2: save at 2 (sync and async), reload at 1 and 3 -------------------------------


def _fsdp_save(rank: int, world_size: int, root_sync: str, root_async: str) -> dict[str, Any]:
    model, optim = build("fsdp")
    train(model, optim, 3, seed=1)
    ref = full_state(model, optim)

    sync = ShardedCheckpointer(Path(root_sync), rank=rank, world_size=world_size, async_save=False)
    sync.save(step=3, attempt=0, state=ckpt_state(model, optim), manifest_fields=FIELDS)

    # Hold DCP's background write until we have changed the model in place, so the test
    # proves the checkpoint holds the state at save() time (staged copy), not later state.
    gate = threading.Event()
    gated_calls = []
    original_save = state_dict_saver.save

    def gated_save(*args: Any, **kwargs: Any) -> Any:
        gated_calls.append(1)
        assert gate.wait(60)
        return original_save(*args, **kwargs)

    state_dict_saver.save = gated_save  # DCP's thread executor looks it up at call time
    try:
        ckpt = ShardedCheckpointer(
            Path(root_async), rank=rank, world_size=world_size, async_save=True
        )
        ckpt.save(step=3, attempt=0, state=ckpt_state(model, optim), manifest_fields=FIELDS)
        in_flight = not ckpt._inflight.done.done() if ckpt._inflight else False
        assert ckpt.poll_commits() == []  # not committed while the write is held
        ckpt.wait_staged()  # the caller's due before it changes the state in place
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        train(model, optim, 1, seed=99)  # moves the optimizer state too
        gate.set()
        commits = ckpt.finalize()
    finally:
        state_dict_saver.save = original_save
    assert gated_calls, "DCP no longer calls state_dict_saver.save from its thread"
    assert in_flight
    assert len(commits) == (1 if rank == 0 else 0)
    return {"ref": ref, "commits": commits}


@pytest.fixture(scope="module")
def fsdp_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    base = tmp_path_factory.mktemp("fsdp")
    results = run_distributed(_fsdp_save, 2, str(base / "sync"), str(base / "async"), timeout_s=240)
    return base / "sync", base / "async", results[0]


def test_fsdp_async_commit_reported(fsdp_saved: tuple[Path, Path, dict[str, Any]]) -> None:
    _sync, root_async, saved = fsdp_saved
    (commit,) = saved["commits"]
    assert commit.step == 3 and commit.path == str(root_async / "step_000000003-a0")
    assert commit.manifest is not None and commit.manifest["files"][".metadata"]["size"] > 0


def _load_fsdp(rank: int, world_size: int, root_sync: str, root_async: str) -> list[Any]:
    return [load_into_fresh("fsdp", r, world_size) for r in (root_sync, root_async)]


def _load_all(
    rank: int, world_size: int, ddp_root: str, root_sync: str, root_async: str
) -> dict[str, Any]:
    # One spawn of 3 processes serves both strategies: spawns dominate the test time.
    return {
        "ddp": load_into_fresh("ddp", ddp_root, world_size),
        "fsdp": _load_fsdp(rank, world_size, root_sync, root_async),
    }


@pytest.fixture(scope="module")
def loaded_at_3(
    ddp_saved: tuple[Path, dict[str, Any]], fsdp_saved: tuple[Path, Path, dict[str, Any]]
) -> list[dict[str, Any]]:
    root_sync, root_async, _ = fsdp_saved
    return run_distributed(
        _load_all, 3, str(ddp_saved[0]), str(root_sync), str(root_async), timeout_s=300
    )


def test_ddp_load_at_world_size_3(
    ddp_saved: tuple[Path, dict[str, Any]], loaded_at_3: list[dict[str, Any]]
) -> None:
    for got in loaded_at_3:
        assert got["ddp"]["step"] == 5
        assert got["ddp"]["rank_extra"] is None
        assert_same(got["ddp"]["full"], ddp_saved[1]["refs"][5])


def check_fsdp_loads(results: list[list[Any]], ref: dict[str, Any]) -> None:
    for from_sync, from_async in results:
        assert from_sync["step"] == from_async["step"] == 3
        assert_same(from_sync["full"], ref)
        # Same as sync, and the in-place update made after save() did not leak in.
        assert_same(from_async["full"], ref)


def test_fsdp_reshard_to_1(fsdp_saved: tuple[Path, Path, dict[str, Any]]) -> None:
    root_sync, root_async, saved = fsdp_saved
    results = run_distributed(_load_fsdp, 1, str(root_sync), str(root_async), timeout_s=240)
    check_fsdp_loads(results, saved["ref"])


def test_fsdp_reshard_to_3(
    fsdp_saved: tuple[Path, Path, dict[str, Any]], loaded_at_3: list[dict[str, Any]]
) -> None:
    check_fsdp_loads([got["fsdp"] for got in loaded_at_3], fsdp_saved[2]["ref"])


# -- failures are never silent ----------------------------------------------------------


def test_background_failure_is_raised(tmp_path: Path) -> None:
    """A failing async write surfaces from poll_commits/finalize as CheckpointSaveError."""
    model, optim = build("plain")
    train(model, optim, 1, seed=0)
    blocker = tmp_path / "ckpt"
    blocker.mkdir()
    ckpt = ShardedCheckpointer(blocker, rank=0, world_size=1, async_save=True)
    ckpt.save(step=1, attempt=0, state=ckpt_state(model, optim), manifest_fields={})
    assert ckpt.finalize()[0].step == 1

    # Make the next folder unwritable from inside: a file where a shard must go.
    target = blocker / "step_000000002-a0"
    target.mkdir()
    (target / "__0_0.distcp").mkdir()
    ckpt.save(step=2, attempt=0, state=ckpt_state(model, optim), manifest_fields={})
    with pytest.raises(CheckpointSaveError, match="step 2"):
        ckpt.finalize()
    assert [i.step for i in list_committed(blocker)] == [1]
    ckpt.close()


def test_unknown_manifest_field_rejected(tmp_path: Path) -> None:
    model, optim = build("plain")
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=False)
    with pytest.raises(ValueError, match="unknown manifest_fields"):
        ckpt.save(step=1, attempt=0, state=ckpt_state(model, optim), manifest_fields={"x": 1})


def test_close_returns_every_commit_and_retention_prunes(tmp_path: Path) -> None:
    model, optim = build("plain")
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=True)
    assert ckpt.load_latest(ckpt_state(model, optim)) is None  # empty root: nothing to load
    for step in range(1, 5):
        ckpt.save(step=step, attempt=0, state=ckpt_state(model, optim), manifest_fields={})
    assert [c.step for c in ckpt.close()] == [1, 2, 3, 4]
    # Retention as the service runs it (elastrain.service.executor), on real DCP folders.
    doomed = retention_plan(tmp_path, keep_last=2)
    assert [p.name for p in doomed] == ["step_000000001-a0", "step_000000002-a0"]
    delete_checkpoints(tmp_path, doomed)
    assert [i.step for i in list_committed(tmp_path)] == [4, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000003-a0", "step_000000004-a0"]
