"""The shape of the torch.distributed.checkpoint (DCP) API elastrain's checkpoints stand on.

The save path is DCP's own machinery (`elastrain.checkpoints.dcp.checkpointer`), extended at
a few points (`writer`, `reader`, `in_memory`, `peer_reader`). A torch upgrade that moves
one of them must fail here, naming what moved, rather than as a wrong checkpoint or a
hang somewhere in a training test.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem, planner, staging, state_dict_saver
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner


def _params(fn: object) -> set[str]:
    return set(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_async_save_takes_a_stager_and_answers_with_both_futures() -> None:
    assert {"storage_writer", "planner", "process_group", "async_stager", "no_dist"} <= _params(
        dcp.async_save
    ), "dcp.async_save's keyword arguments changed (checkpointer.py calls it)"
    fields = {f for f in state_dict_saver.AsyncSaveResponse.__dataclass_fields__}
    assert fields == {"staging_completion", "upload_completion"}
    assert {"storage_writer", "planner", "process_group", "no_dist"} <= _params(dcp.save)


def test_the_thread_executor_looks_save_up_at_call_time() -> None:
    # Tests hold a background write by patching `state_dict_saver.save`.
    from torch.distributed.checkpoint import _async_thread_executor

    source = inspect.getsource(_async_thread_executor)
    assert "from torch.distributed.checkpoint.state_dict_saver import save" in source


def test_the_default_stager_stages_in_its_thread() -> None:
    options = staging.StagingOptions(
        use_pinned_memory=False,
        use_shared_memory=False,
        use_async_staging=True,
        use_non_blocking_copy=False,
    )
    stager = staging.DefaultStager(options)
    try:
        source = {"w": torch.arange(4.0)}
        staged = stager.stage(source)
        assert hasattr(staged, "result"), "DefaultStager no longer answers with a future"
        copy = staged.result()  # type: ignore[union-attr]
        source["w"].add_(1)
        assert torch.equal(copy["w"], torch.arange(4.0))  # a copy, not a view
    finally:
        stager.close()


def test_plan_caching_is_keyed_per_planner_in_class_level_caches() -> None:
    assert "enable_plan_caching" in _params(DefaultSavePlanner)
    save_planner = DefaultSavePlanner(enable_plan_caching=True)
    assert isinstance(save_planner._cached_plans_key, str)
    caches = [n for n in dir(planner.SavePlanner) if n.startswith("_cached_")]
    assert {"_cached_save_plan", "_cached_all_plans", "_cached_global_plan"} <= set(caches)
    for name in caches:
        assert isinstance(getattr(planner.SavePlanner, name), dict), name


def test_the_file_system_writer_opens_every_file_through_its_fs(tmp_path: Path) -> None:
    assert {"single_file_per_rank", "sync_files"} <= _params(filesystem.FileSystemWriter)
    writer = filesystem.FileSystemWriter(tmp_path, single_file_per_rank=True, sync_files=True)
    assert isinstance(writer.fs, filesystem.FileSystem)
    assert {"path", "mode"} <= _params(filesystem.FileSystem.create_stream)
    assert {"metadata", "results"} <= _params(filesystem.FileSystemWriter.finish)
    assert {"plan", "planner"} <= _params(filesystem.FileSystemWriter.write_data)


def test_the_reader_and_planner_hooks_are_where_they_were(tmp_path: Path) -> None:
    assert {"plan", "planner"} <= _params(filesystem.FileSystemReader.read_data)
    # The verifying reader hands DCP's read_data its maps through the reader's fs.
    assert isinstance(filesystem.FileSystemReader(tmp_path).fs, filesystem.FileSystem)
    assert {"plan"} <= _params(filesystem.FileSystemReader.prepare_local_plan)
    assert {"read_item", "value"} <= _params(DefaultLoadPlanner.load_bytes)
    assert {"read_item"} <= _params(DefaultLoadPlanner.resolve_tensor)
    assert hasattr(torch.serialization, "get_crc32_options")
    assert hasattr(torch.serialization, "set_crc32_options")


def test_the_in_memory_checkpoint_hooks_are_where_they_were() -> None:
    # Peer memory (`elastrain.workers.memory`): a snapshot resolves a plan's items against
    # the live state through the save planner, and the peer reader serves DCP's read items.
    from torch.distributed._shard._utils import narrow_tensor_by_index

    assert {"state_dict", "storage_meta", "is_coordinator"} <= _params(
        DefaultSavePlanner.set_up_planner
    )
    assert {"write_item"} <= _params(DefaultSavePlanner.resolve_data)
    assert {"index"} <= _params(DefaultSavePlanner.lookup_object)
    assert {"read_item", "tensor"} <= _params(DefaultLoadPlanner.commit_tensor)
    assert {"storage_index", "storage_offsets", "lengths", "type"} <= set(
        planner.ReadItem.__dataclass_fields__
    )
    assert {"index", "type", "tensor_data"} <= set(planner.WriteItem.__dataclass_fields__)
    assert {"storage_writer", "process_group", "no_dist"} <= _params(state_dict_saver.save)
    assert torch.equal(narrow_tensor_by_index(torch.arange(6), [2], [3]), torch.arange(2, 5))
    targets = [torch.zeros(3)]
    torch._foreach_copy_(targets, [torch.ones(3)], non_blocking=False)
    assert torch.equal(targets[0], torch.ones(3))


def test_a_save_and_an_async_save_through_them_round_trip(tmp_path: Path) -> None:
    from elastrain.checkpoints.dcp import ShardedCheckpointer

    # Two saves through one stager: torch 2.11's emptied its copy table after a stage, and
    # every async save after a job's first failed.
    state = {"model": {"w": torch.arange(6.0)}}
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=True)
    for step in (1, 2):
        ckpt.save(step=step, attempt=0, state=state, manifest_fields={})
        ckpt.wait_staged()
        state["model"]["w"].add_(10)  # after the staging copy: not in the checkpoint
    assert [c.step for c in ckpt.close()] == [1, 2]
    loaded = {"model": {"w": torch.zeros(6)}}
    outcome = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=False).load_latest(
        loaded
    )
    assert outcome is not None and outcome.info.step == 2
    assert torch.equal(loaded["model"]["w"], torch.arange(6.0) + 10)
