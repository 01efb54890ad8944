"""An in-memory DCP checkpoint (`elastrain.workers.memory.in_memory`) in one process: saved with
DCP's planner into memory, loaded back through DCP's load planner, bit for bit, into
targets of any layout (a non-contiguous view included), pickled items too; the items
each rank holds, in one order every rank agrees on; and pickled items made once while
their values hold."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from elastrain.workers.memory.in_memory import MemoryWriter, held_blob, held_items
from elastrain.workers.memory.peer_reader import PeerReader


def state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(6, 4, generator=gen),
        "b": torch.randn(5, generator=gen).to(torch.bfloat16),
        "step": torch.tensor(7.0),
        "groups": [{"lr": 0.25, "betas": (0.9, 0.95)}],
    }


def test_saved_to_memory_and_loaded_bit_for_bit() -> None:
    source = state()
    writer = MemoryWriter()
    metadata = state_dict_saver.save(source, storage_writer=writer, no_dist=True)
    # A transposed (non-contiguous) target and fresh ones.
    target = {
        "w": torch.zeros(4, 6).t(),
        "b": torch.zeros(5, dtype=torch.bfloat16),
        "step": torch.tensor(0.0),
        "groups": [{"lr": 0.0, "betas": (0.0, 0.0)}],
    }
    reader = PeerReader(metadata, holder={0: 0}, local={0: writer.blob}, group=None)
    dcp.load(target, storage_reader=reader, no_dist=True)
    expected = state()
    for key in ("w", "b", "step"):
        assert torch.equal(target[key], expected[key]), key
    assert target["groups"] == expected["groups"]


def test_held_items_say_each_items_layout_in_one_order() -> None:
    writer = MemoryWriter()
    metadata = state_dict_saver.save(state(), storage_writer=writer, no_dist=True)
    held = held_items(metadata, 0)
    # DCP flattens containers: each leaf that is no tensor is one pickled item.
    assert [(i.fqn, layout) for i, layout in held] == [
        ("b", (torch.bfloat16, torch.Size([5]))),
        ("groups.0.betas", None),
        ("groups.0.lr", None),
        ("step", (torch.float32, torch.Size([]))),
        ("w", (torch.float32, torch.Size([6, 4]))),
    ]
    assert held_items(metadata, 1) == []


def test_unchanged_pickled_items_are_not_pickled_again() -> None:
    source = state()
    writer = MemoryWriter()
    state_dict_saver.save(source, storage_writer=writer, no_dist=True)
    cache: dict[Any, Any] = {}

    def keep(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
        planner = DefaultSavePlanner()
        planner.set_up_planner(sd, storage_meta=None, is_coordinator=False)
        return {i.fqn: t for i, t in held_blob(writer.items, planner, cache).items()}

    first = keep(source)
    same = keep(source)
    assert same["groups.0.lr"] is first["groups.0.lr"]  # the value did not change
    source["groups"][0]["lr"] = 0.5
    changed = keep(source)
    assert changed["groups.0.lr"] is not first["groups.0.lr"]
    assert changed["groups.0.betas"] is first["groups.0.betas"]
    assert torch.load(io.BytesIO(changed["groups.0.lr"].numpy().tobytes())) == 0.5
    source["groups"][0]["lr"] = 1  # equal to 1.0 but not the same pickle
    assert torch.load(io.BytesIO(keep(source)["groups.0.lr"].numpy().tobytes())) == 1
