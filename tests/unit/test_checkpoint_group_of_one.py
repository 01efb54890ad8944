"""A checkpointer whose group has one rank saves without DCP's collectives (they only
pickle plans and write results to hand them to the same rank, holding the GIL an async
save's training thread waits for), and writes exactly what a save through them writes:
the same shard bytes, the same `.metadata` values (but its per-save id; its pickle shares
the strings the collectives' unpickling would have copied, so its bytes differ, as they
differ between any two saves), a commit with digests.
Real gloo group of one, real files, async saves as the GPU host runs them."""

from __future__ import annotations

import filecmp
import pickle
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

from elastrain.checkpoints.dcp import ShardedCheckpointer
from elastrain.checkpoints.manifest import read_manifest
from tests.unit.dist_utils import run_distributed
from tests.unit.test_checkpoints_dcp import build, train


def _save_both_ways(rank: int, world_size: int, root: str) -> dict[str, int]:
    model, optim = build("plain")
    train(model, optim, steps=2, seed=0)
    m, o = get_state_dict(model, optim)
    calls = {"gather_object": 0}
    original = dist.gather_object

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["gather_object"] += 1
        return original(*args, **kwargs)

    dist.gather_object = counting  # DCP's _DistWrapper looks it up on the module
    counts = {}
    try:
        for alone in (True, False):
            calls["gather_object"] = 0
            ckpt = ShardedCheckpointer(
                Path(root) / str(alone),
                rank=rank,
                world_size=world_size,
                async_save=True,
                async_staging=True,
            )
            assert ckpt._save_alone  # a group of one
            ckpt._save_alone = alone  # False: through DCP's collectives, as before
            ckpt.save(step=1, attempt=0, state={"model": m, "optim": o}, manifest_fields={})
            ckpt.wait_staged()
            assert [c.step for c in ckpt.close()] == [1]
            counts[str(alone)] = calls["gather_object"]
    finally:
        dist.gather_object = original
    return counts


def same_metadata_values(a: Path, b: Path) -> bool:
    ma, mb = (pickle.loads((p / ".metadata").read_bytes()) for p in (a, b))
    assert ma.storage_meta != mb.storage_meta  # a per-save id, by design
    ma.storage_meta = mb.storage_meta = None
    return bool(ma == mb)


def test_group_of_one_saves_the_same_without_collectives(tmp_path: Path) -> None:
    [counts] = run_distributed(_save_both_ways, 1, str(tmp_path))
    assert counts == {"True": 0, "False": 2}  # the plans and the write results
    alone, collective = (tmp_path / str(a) / "step_000000001-a0" for a in (True, False))
    assert sorted(p.name for p in alone.glob("*.distcp")) == ["__0_0.distcp"]
    assert filecmp.cmp(alone / "__0_0.distcp", collective / "__0_0.distcp", shallow=False)
    assert same_metadata_values(alone, collective)
    # The streamed digest made it into the commit, as with collectives.
    files = read_manifest(alone).files
    assert files["__0_0.distcp"] == read_manifest(collective).files["__0_0.distcp"]
