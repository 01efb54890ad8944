"""Checkpoint digests by name (`checkpoints/manifest.py`) and the load that verifies the shards
it reads before it decodes them (`checkpoints/dcp/reader.py`):

- one flipped byte is caught with XXH3-128 and with sha256, the load falls back to the
  previous checkpoint, and a rank whose own files are intact does not touch its state
  when another rank's shard is corrupt;
- a manifest written the old way (format 1, `{size, sha256}` per file) still loads and
  still verifies;
- a manifest naming an algorithm nobody knows is refused with that name, not loaded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from elastrain.checkpoints.catalog import find_latest_good
from elastrain.checkpoints.dcp import ShardedCheckpointer
from elastrain.checkpoints.dcp import reader as reader_module
from elastrain.checkpoints.integrity import CorruptCheckpoint, digest_file, verify
from elastrain.checkpoints.manifest import (
    ALGORITHMS,
    ManifestError,
    UnknownDigestAlgorithm,
    algorithm_for_setting,
    new_hasher,
    read_manifest,
)
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

torch.set_num_threads(1)


def flip_one_byte(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x01  # same size: only a digest sees it
    path.write_bytes(bytes(data))


def save_two(root: Path, digest: str) -> dict[int, dict[str, Any]]:
    """Steps 1 and 2 of a one-process model saved with `digest`; the full state of each."""
    model, optim = build("plain")
    ckpt = ShardedCheckpointer(root, rank=0, world_size=1, async_save=False, digest=digest)
    refs = {}
    for step in (1, 2):
        train(model, optim, 1, seed=step)
        ckpt.save(step=step, attempt=0, state=ckpt_state(model, optim), manifest_fields=FIELDS)
        refs[step] = full_state(model, optim)
    ckpt.close()
    return refs


# -- the algorithms -----------------------------------------------------------------------


def test_algorithms_and_settings() -> None:
    data = bytes(range(256)) * 1000
    for algorithm, reference in (
        ("xxh3-128", xxhash.xxh3_128(data).hexdigest()),
        ("sha256", hashlib.sha256(data).hexdigest()),
    ):
        h = new_hasher(algorithm)
        h.update(data[:1000])
        h.update(memoryview(data)[1000:])
        assert h.hexdigest() == reference
    assert set(ALGORITHMS) == {"xxh3-128", "sha256"}
    assert algorithm_for_setting("xxh3") == "xxh3-128"
    assert algorithm_for_setting("sha256") == "sha256"
    assert algorithm_for_setting("xxh3-128") == "xxh3-128"
    for bad in ("md5", "XXH3", ""):
        with pytest.raises(UnknownDigestAlgorithm, match=repr(bad)):
            new_hasher(bad)
        with pytest.raises(UnknownDigestAlgorithm, match="known: xxh3-128, sha256"):
            algorithm_for_setting(bad)


# -- one process ----------------------------------------------------------------------------


@pytest.mark.parametrize(("setting", "algorithm"), [("xxh3", "xxh3-128"), ("sha256", "sha256")])
def test_one_flipped_byte_is_caught(tmp_path: Path, setting: str, algorithm: str) -> None:
    refs = save_two(tmp_path, setting)
    newest = tmp_path / "step_000000002-a0"
    manifest = read_manifest(newest)
    assert {e["algorithm"] for e in manifest.files.values()} == {algorithm}
    for name, entry in manifest.files.items():
        assert entry["digest"] == digest_file(newest / name, algorithm), name

    # A shard: found by the rank that reads it, during the load.
    flip_one_byte(newest / "__0_0.distcp")
    verify(newest, digests_of=())  # same size: names and sizes cannot tell
    got = load_into_fresh("plain", str(tmp_path), 1)
    assert got["step"] == 1
    assert_same(got["full"], refs[1])
    reason = dict(got["skipped"])[str(newest)]
    assert f"digest mismatch: __0_0.distcp {algorithm}" in reason

    # A small file (checked on rank 0 while choosing): DCP's .metadata.
    flip_one_byte(tmp_path / "step_000000001-a0" / ".metadata", at=20)
    info, skipped = find_latest_good(tmp_path)
    assert info is None
    assert (
        f"digest mismatch: .metadata {algorithm}"
        in dict(skipped)[str(tmp_path / "step_000000001-a0")]
    )


def test_a_corrupt_only_checkpoint_leaves_the_state_alone(tmp_path: Path) -> None:
    save_two(tmp_path, "xxh3")
    for step in (1, 2):
        flip_one_byte(tmp_path / f"step_00000000{step}-a0" / "__0_0.distcp")
    model, optim = build("plain")
    train(model, optim, 1, seed=42)
    before = full_state(model, optim)
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=False)
    state = ckpt_state(model, optim)
    assert ckpt.load_latest(state) is None
    assert_same(full_state(model, optim), before)  # nothing copied before verification


def write_format_1_manifest(folder: Path) -> None:
    """Rewrite a checkpoint's manifest as the code before format 2 wrote it: version 1,
    `{size, sha256}` per file, the digests taken here with hashlib."""
    path = folder / "manifest.json"
    data = json.loads(path.read_text())
    data["format_version"] = 1
    data["files"] = {
        name: {
            "size": entry["size"],
            "sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest(),
        }
        for name, entry in data["files"].items()
    }
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def test_a_format_1_sha256_manifest_loads_and_verifies(tmp_path: Path) -> None:
    refs = save_two(tmp_path, "xxh3")  # the digests are rewritten below, by hashlib
    for step in (1, 2):
        write_format_1_manifest(tmp_path / f"step_00000000{step}-a0")
    manifest = read_manifest(tmp_path / "step_000000002-a0")
    assert manifest.format_version == 1
    assert {e["algorithm"] for e in manifest.files.values()} == {"sha256"}
    got = load_into_fresh("plain", str(tmp_path), 1)
    assert got["step"] == 2 and not got["skipped"]
    assert_same(got["full"], refs[2])

    flip_one_byte(tmp_path / "step_000000002-a0" / "__0_0.distcp")
    got = load_into_fresh("plain", str(tmp_path), 1)
    assert got["step"] == 1
    assert_same(got["full"], refs[1])
    reason = dict(got["skipped"])[str(tmp_path / "step_000000002-a0")]
    assert "digest mismatch: __0_0.distcp sha256" in reason


def test_an_unknown_algorithm_is_refused_by_name(tmp_path: Path) -> None:
    refs = save_two(tmp_path, "xxh3")
    newest = tmp_path / "step_000000002-a0"
    data = json.loads((newest / "manifest.json").read_text())
    data["files"]["__0_0.distcp"]["algorithm"] = "md5"
    (newest / "manifest.json").write_text(json.dumps(data))

    with pytest.raises(ManifestError, match=r"__0_0\.distcp.*unknown digest algorithm 'md5'"):
        read_manifest(newest)
    got = load_into_fresh("plain", str(tmp_path), 1)
    assert got["step"] == 1
    assert_same(got["full"], refs[1])
    assert "unknown digest algorithm 'md5'" in dict(got["skipped"])[str(newest)]

    # An entry with neither form of digest is refused too.
    del data["files"]["__0_0.distcp"]["algorithm"]
    (newest / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="unknown digest algorithm None"):
        read_manifest(newest)


def test_corrupt_checkpoint_survives_pickling(tmp_path: Path) -> None:
    """Raised inside a DCP load, it reaches the other ranks pickled."""
    import pickle

    e = pickle.loads(pickle.dumps(CorruptCheckpoint(tmp_path, "digest mismatch: x")))
    assert isinstance(e, CorruptCheckpoint) and e.reason == "digest mismatch: x"
    assert e.path == tmp_path


# -- two FSDP ranks: each reads only its own shard -----------------------------------------


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The FSDP model's sharded parameters only: every item lives in its own rank's shard
    file (no replicated tensors, which DCP may store in another rank's file)."""
    return {"model": get_model_state_dict(model)}


def _two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    mapped: list[str] = []
    original = reader_module.open_regular

    def record(path: str) -> Any:
        mapped.append(Path(path).name)
        return original(path)

    reader_module.open_regular = record
    model, optim = build("fsdp")
    ckpt = ShardedCheckpointer(Path(root), rank=rank, world_size=world_size, async_save=False)
    refs = {}
    for step in (1, 2):
        train(model, optim, 1, seed=step)
        ckpt.save(step=step, attempt=0, state=model_state(model), manifest_fields=FIELDS)
        refs[step] = full_state(model, optim)["model"]
    ckpt.close()
    out: dict[str, Any] = {}

    # Rank 1's shard of step 2 is corrupt; rank 0 never reads that file.
    if rank == 0:
        flip_one_byte(Path(root, "step_000000002-a0", "__1_0.distcp"))
    dist.barrier()
    model, optim = build("fsdp")
    loader = ShardedCheckpointer(Path(root), rank=rank, world_size=world_size, async_save=False)
    outcome = loader.load_latest(model_state(model))
    assert outcome is not None
    out["fallback_step"] = outcome.info.step
    out["fallback_skipped"] = outcome.skipped
    assert_same(full_state(model, optim)["model"], refs[1])

    # Now step 1's too: no good checkpoint, and neither rank's state was touched (rank 0's
    # own shards are intact: it must wait for rank 1's verdict before copying anything).
    if rank == 0:
        flip_one_byte(Path(root, "step_000000001-a0", "__1_0.distcp"))
    dist.barrier()
    model, optim = build("fsdp")
    before = full_state(model, optim)["model"]
    out["none_left"] = loader.load_latest(model_state(model)) is None
    out["untouched"] = True
    try:
        assert_same(full_state(model, optim)["model"], before)
    except AssertionError:
        out["untouched"] = False
    out["mapped"] = sorted(set(mapped))
    return out


def test_two_ranks_agree_before_copying(tmp_path: Path) -> None:
    results = run_distributed(_two_ranks, 2, str(tmp_path), timeout_s=240)
    # The setup this test needs: each rank reads only its own shard.
    assert results[0]["mapped"] == ["__0_0.distcp"]
    assert results[1]["mapped"] == ["__1_0.distcp"]
    for out in results:
        assert out["fallback_step"] == 1
        assert out["none_left"] is True
        assert out["untouched"] is True
    reasons = dict(results[0]["fallback_skipped"])
    assert "digest mismatch: __1_0.distcp xxh3-128" in reasons[str(tmp_path / "step_000000002-a0")]
    assert "another rank" not in reasons[str(tmp_path / "step_000000002-a0")]
