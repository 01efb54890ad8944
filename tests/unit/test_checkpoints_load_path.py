"""The verified load (`checkpoints/dcp/reader.py`): DCP's own reader, over the shard files
each rank verified first.

- a shard corrupt in its last record, truncated, missing, or a link (to an intact copy
  elsewhere) is refused by the reader before any byte reaches the state;
- DCP decodes the verified bytes: a file replaced after it was hashed is not what loads;
- the export's reader refuses a pickled item, and none of it runs;
- on two FSDP ranks with Adam, a rank reads the replicated optimizer values DCP stored in
  the other rank's file: a flipped byte in one of those records makes both ranks fall
  back, and leaves both states untouched when nothing older is left.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.fsdp import fully_shard

from elastrain.checkpoints.dcp import ShardedCheckpointer
from elastrain.checkpoints.dcp import reader as reader_module
from elastrain.checkpoints.dcp.checkpointer import corrupt_shard_reason
from elastrain.checkpoints.dcp.untrusted import UntrustedCheckpoint, UntrustedReader
from elastrain.checkpoints.integrity import describe_files
from elastrain.checkpoints.manifest import read_manifest
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
from tests.unit.test_checkpoints_digest import flip_one_byte, save_two

torch.set_num_threads(1)

SHARD = "__0_0.distcp"


class _Planted:
    """A pickle that, unpickled, writes a file: what a job's code could save as an item."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _flip_last_record(folder: Path) -> None:
    shard = folder / SHARD
    flip_one_byte(shard, at=shard.stat().st_size - 400)


def _truncate(folder: Path) -> None:
    shard = folder / SHARD
    os.truncate(shard, shard.stat().st_size - 1)


def _remove(folder: Path) -> None:
    (folder / SHARD).unlink()


def _link_to_a_copy(folder: Path) -> None:
    """The same bytes, elsewhere, through a link: only the link is wrong."""
    elsewhere = folder.parent / "elsewhere.distcp"
    shutil.move(folder / SHARD, elsewhere)
    (folder / SHARD).symlink_to(elsewhere)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_flip_last_record, f"digest mismatch: {SHARD} xxh3-128"),
        (_truncate, f"size mismatch: {SHARD}"),
        (_remove, f"cannot read {SHARD}"),
        (_link_to_a_copy, f"cannot read {SHARD}"),
    ],
)
def test_the_reader_refuses_a_bad_shard_before_touching_the_state(
    tmp_path: Path, damage: Callable[[Path], None], reason: str
) -> None:
    save_two(tmp_path, "xxh3")
    folder = tmp_path / "step_000000002-a0"
    expected = read_manifest(folder).files
    damage(folder)
    model, optim = build("plain")
    train(model, optim, 1, seed=7)
    before = full_state(model, optim)
    reader = reader_module.VerifyingReader(folder, expected=expected, process_group=None)
    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException: a BaseException
        dcp.load(ckpt_state(model, optim), storage_reader=reader, no_dist=True)
    found = corrupt_shard_reason(raised.value)
    assert found is not None and found.startswith(reason), found
    assert_same(full_state(model, optim), before)  # nothing copied before the verdict


def test_a_bad_shard_falls_back_to_the_older_checkpoint(tmp_path: Path) -> None:
    refs = save_two(tmp_path, "xxh3")
    _link_to_a_copy(tmp_path / "step_000000002-a0")
    got = load_into_fresh("plain", str(tmp_path), 1)
    assert got["step"] == 1
    assert_same(got["full"], refs[1])
    assert f"cannot read {SHARD}" in dict(got["skipped"])[str(tmp_path / "step_000000002-a0")]


def test_what_loads_is_the_bytes_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 1's shard is renamed over step 2's once step 2's was hashed: the load still
    gives step 2, decoded from the file that was hashed, not from a file opened again."""
    refs = save_two(tmp_path, "xxh3")
    newest = tmp_path / "step_000000002-a0"
    agree = reader_module.VerifyingReader._agree

    def then_replace(self: reader_module.VerifyingReader, problem: str | None) -> None:
        agree(self, problem)
        shutil.copy(tmp_path / "step_000000001-a0" / SHARD, tmp_path / "swap")
        os.replace(tmp_path / "swap", newest / SHARD)

    monkeypatch.setattr(reader_module.VerifyingReader, "_agree", then_replace)
    got = load_into_fresh("plain", str(tmp_path), 1)
    assert got["step"] == 2 and not got["skipped"]
    assert_same(got["full"], refs[2])


def test_the_export_reader_refuses_a_pickled_item_unrun(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    folder = tmp_path / "step"
    dcp.save({"model": {"obj": _Planted(marker)}}, checkpoint_id=folder, no_dist=True)
    reader = UntrustedReader(folder, expected=describe_files(folder), process_group=None)
    with pytest.raises(BaseException) as raised:  # in DCP's CheckpointException
        dcp.load({"model": {"obj": None}}, storage_reader=reader, no_dist=True)
    failures = getattr(raised.value, "failures", {0: (raised.value, None)})
    assert any(
        isinstance(e, UntrustedCheckpoint) and "model.obj is a pickled item" in str(e)
        for e, _trace in failures.values()
    ), raised.value
    assert not marker.exists()


# -- two FSDP ranks, model and optimizer -------------------------------------------------

WIDTH = 128


def build_wide() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """FSDP layers large enough that the replicated optimizer values (Adam's step, the
    param groups) are a small part of each shard file, as in real models."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_wide(model: torch.nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    x = torch.randn(4, WIDTH, generator=g)
    optim.zero_grad()
    F.mse_loss(model(x), x).backward()
    optim.step()


def _replicated_record(folder: Path) -> tuple[str, int, int]:
    """(file, offset, length) of one of Adam's replicated `step` records."""
    metadata = dcp.FileSystemReader(folder).read_metadata()
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: kv[0].fqn):
        if index.fqn.startswith("optim.state.") and index.fqn.endswith(".step"):
            return info.relative_path, info.offset, info.length
    raise AssertionError("no replicated step record")


def _two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    mapped: list[str] = []
    original = reader_module.open_regular

    def record(path: str) -> Any:
        mapped.append(Path(path).name)
        return original(path)

    reader_module.open_regular = record
    model, optim = build_wide()
    ckpt = ShardedCheckpointer(Path(root), rank=rank, world_size=world_size, async_save=False)
    refs = {}
    for step in (1, 2):
        train_wide(model, optim, seed=step)
        ckpt.save(step=step, attempt=0, state=ckpt_state(model, optim), manifest_fields=FIELDS)
        refs[step] = full_state(model, optim)
    ckpt.close()
    out: dict[str, Any] = {}

    def load() -> tuple[int | None, dict[str, str], bool]:
        """(step loaded or None, skipped, whether the state is what it was when None)."""
        model, optim = build_wide()
        train_wide(model, optim, seed=99)
        before = full_state(model, optim)
        loader = ShardedCheckpointer(Path(root), rank=rank, world_size=world_size, async_save=False)
        state = ckpt_state(model, optim)
        outcome = loader.load_latest(state)
        if outcome is None:
            try:
                assert_same(full_state(model, optim), before)
                return None, {}, True
            except AssertionError:
                return None, {}, False
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        assert_same(full_state(model, optim), refs[outcome.info.step])
        return outcome.info.step, dict(outcome.skipped), True

    out["step"], _, _ = load()
    out["mapped"] = sorted(set(mapped))
    for step in (2, 1):  # a byte of a replicated record: step 2, then step 1 as well
        if rank == 0:
            name, offset, length = _replicated_record(Path(root, f"step_00000000{step}-a0"))
            flip_one_byte(Path(root, f"step_00000000{step}-a0", name), at=offset + length // 2)
        dist.barrier()
        out[f"after_{step}"] = load()
    reader_module.open_regular = original
    return out


def test_two_ranks_refuse_a_corrupt_replicated_record(tmp_path: Path) -> None:
    results = run_distributed(_two_ranks, 2, str(tmp_path), timeout_s=300)
    # The setup this test needs: a rank read (and so verified) the other rank's file.
    assert any(set(out["mapped"]) - {f"__{rank}_0.distcp"} for rank, out in enumerate(results)), (
        results
    )
    for out in results:
        assert out["step"] == 2
        step, skipped, _ = out["after_2"]
        assert step == 1
        assert "digest mismatch" in skipped[str(tmp_path / "step_000000002-a0")]
        assert out["after_1"] == (None, {}, True)  # nothing left, the state untouched
