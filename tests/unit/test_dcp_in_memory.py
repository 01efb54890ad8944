"""An in-memory DCP checkpoint (`elastrain.workers.memory.in_memory`) in one process: saved with
DCP's planner into memory, loaded back through DCP's load planner, bit for bit, into
targets of any layout (a non-contiguous view included), pickled items too; and the
arena that lays one rank's tensor items side by side."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_saver

from elastrain.workers.memory.in_memory import ARENA_ALIGN, MemoryWriter, arena_of, held_items
from elastrain.workers.memory.peer_reader import PeerReader


class Alone:
    """The Transport of a group of one."""

    rank = 0

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def stream(
        self,
        sends: Mapping[int, Sequence[torch.Tensor]],
        recvs: Mapping[int, Sequence[torch.Tensor]],
    ) -> int:
        assert not sends and not recvs  # everything is local
        return 0


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
    source["w"].add_(1.0)  # the copy is a copy: later updates do not leak into it
    # A transposed (non-contiguous) target and fresh ones.
    target = {
        "w": torch.zeros(4, 6).t(),
        "b": torch.zeros(5, dtype=torch.bfloat16),
        "step": torch.tensor(0.0),
        "groups": [{"lr": 0.0, "betas": (0.0, 0.0)}],
    }
    reader = PeerReader(metadata, holder={0: 0}, local={0: writer.blob}, transport=Alone())
    dcp.load(target, storage_reader=reader, no_dist=True)
    expected = state()
    for key in ("w", "b", "step"):
        assert torch.equal(target[key], expected[key]), key
    assert target["groups"] == expected["groups"]


def test_the_arena_lays_tensor_items_side_by_side_aligned() -> None:
    writer = MemoryWriter(copy=False)
    metadata = state_dict_saver.save(state(), storage_writer=writer, no_dist=True)
    arena = arena_of(metadata, 0)
    assert {i.fqn for i, *_ in arena.tensors} == {"b", "step", "w"}
    # DCP flattens containers: each leaf that is no tensor is one pickled item.
    assert [i.fqn for i in arena.pickled] == ["groups.0.betas", "groups.0.lr"]
    assert all(offset % ARENA_ALIGN == 0 for _, offset, _, _ in arena.tensors)
    buffer = torch.zeros(arena.nbytes, dtype=torch.uint8)
    views = arena.views(buffer)
    (offset,) = [offset for i, offset, _, _ in arena.tensors if i.fqn == "w"]
    views[next(i for i in views if i.fqn == "w")].fill_(3.0)
    # A view of the buffer, not a copy.
    assert buffer[offset : offset + 96].view(torch.float32).eq(3.0).all()
    assert torch.cat([buffer[:offset], buffer[offset + 96 :]]).count_nonzero() == 0
    assert held_items(metadata, 0) == sorted(held_items(metadata, 0), key=lambda i: i.fqn)


def test_unchanged_pickled_items_are_not_pickled_again() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from elastrain.workers.memory.in_memory import keep_items

    source = state()
    writer = MemoryWriter(copy=False)
    state_dict_saver.save(source, storage_writer=writer, no_dist=True)
    cache: dict[Any, Any] = {}

    def keep(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
        planner = DefaultSavePlanner()
        planner.set_up_planner(sd, storage_meta=None, is_coordinator=False)
        return {i.fqn: t for i, t in keep_items(writer.items, planner, pickled=cache).items()}

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
