"""Peer memory's refresh: every rank copies its shard to host memory and sends the copy to
its buddy on another node (`elastrain.workers.memory.buddy`), every `checkpoint.memory_every` steps
(`elastrain.workers.memory.pacing`).

A snapshot is an in-memory DCP checkpoint (`elastrain.workers.memory.in_memory`): the first
refresh of an attempt plans it collectively with DCP's save planner (the same items,
deduplication and metadata as a disk checkpoint of the same state); later refreshes reuse
that plan and only copy, locally. The buddy copy goes over a gloo group of its own,
point to point, in buckets (`elastrain.workers.memory.transfer`): a small header with the byte
sizes of the sender's items, then the items' raw bytes.

Two generations are kept. A refresh writes into the buffers of the older one and keeps
the newest whole one: a refresh torn by a failure leaves that one whole on every rank (each
rank finished it before the training step that followed, whose collectives every rank
passed). The torn one is kept too, with what is whole of it (this rank's own copy, and the
wards' that came in full): when a node dies mid-exchange, its ranks' copies may have
reached their buddies already, and then the survivors together hold the newest step.
`sources.choose_source` picks the newest generation the survivors' copies cover.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem

from elastrain.contracts.spec import JobSpec
from elastrain.workers.api import TrainContext
from elastrain.workers.comm_release import group_forming
from elastrain.workers.memory.buddy import buddies, wards
from elastrain.workers.memory.in_memory import (
    Arena,
    Blob,
    MemoryWriter,
    arena_buffer,
    arena_of,
    as_bytes,
    keep_items,
)
from elastrain.workers.memory.pacing import RefreshPacer, overhead
from elastrain.workers.memory.sources import Generation
from elastrain.workers.memory.transfer import stream
from elastrain.workers.strategies import Strategy

log = logging.getLogger("elastrain.workers.memory")

#: Generations kept: the newest whole one, and the one being written.
KEPT = 2


@dataclass
class Snapshot:
    """One generation held by this process: items of the ranks in `blobs` (its own and
    its wards'), and the metadata of the whole in-memory checkpoint."""

    generation: Generation
    metadata: Metadata
    blobs: dict[int, Blob]
    arenas: dict[int, torch.Tensor]
    """Per rank held, the flat buffer its tensor items are views of (`Arena`)."""
    whole: bool = True
    """Every ward's copy came in (False: a torn refresh; never kept over a whole one)."""

    @property
    def nbytes(self) -> int:
        pickled = sum(
            t.numel() for b in self.blobs.values() for t in b.values() if t.dtype == torch.uint8
        )
        return sum(a.numel() for a in self.arenas.values()) + pickled


@dataclass
class RefreshStats:
    refreshes: int = 0
    every: int = 1
    refresh_s: float | None = None
    step_s: float | None = None
    bytes_sent: int = 0
    held_bytes: int = 0

    @property
    def overhead(self) -> float | None:
        if self.refresh_s is None or self.step_s is None:
            return None
        return overhead(self.refresh_s, self.step_s, self.every)

    def describe(self) -> str:
        share = self.overhead
        cost = (
            f", {self.refresh_s * 1e3:.1f} ms each = {share:.1%} of step time"
            if share is not None and self.refresh_s is not None
            else ""
        )
        return (
            f"{self.refreshes} refreshes, every {self.every} step(s){cost}, "
            f"{self.held_bytes / 1e6:.1f} MB held"
        )


@dataclass
class PeerRefresher:
    """One attempt's refreshes on one rank; every rank of the group calls `after_step`
    after every optimizer step (refreshes are collective)."""

    ctx: TrainContext
    group: dist.ProcessGroup
    buddy: int | None
    wards: list[int]
    pacer: RefreshPacer
    periodic: bool = True
    """Whether to refresh every `memory_every` steps; off when all ranks share a node: no
    copy can then outlive a node loss, and a resize STOP refreshes at its step anyway."""
    stats: RefreshStats = field(default_factory=RefreshStats)
    _items: list[WriteItem] | None = None
    _metadata: Metadata | None = None
    _arenas: dict[int, Arena] = field(default_factory=dict)
    _pickled: dict[MetadataIndex, tuple[Any, torch.Tensor]] = field(default_factory=dict)
    """This rank's pickled items as last made, with their values (`keep_items`)."""
    _views: dict[tuple[int, int], Blob] = field(default_factory=dict)
    """Arena views by (rank, buffer address): buffers are recycled, so are their views."""

    @classmethod
    def join(cls, ctx: TrainContext, spec: JobSpec) -> PeerRefresher:
        """Collective (every rank, same point): a gloo group for peer memory (host
        tensors, whatever the training backend) and every rank's node."""
        with group_forming():  # a rank blocked in an exchange is freed by a release too
            group = dist.new_group(backend="gloo")
        nodes: list[str] = [""] * ctx.world_size
        dist.all_gather_object(nodes, ctx.node or socket.gethostname(), group=group)
        buddy_of = buddies(nodes)
        if ctx.rank == 0 and ctx.world_size > 1 and buddy_of[0] is None:
            log.info("peer memory: all %d ranks on one node, no buddy copy possible (a "
                     "node loss resumes from the checkpoint; a resize hands the state on "
                     "from memory)", ctx.world_size)  # fmt: skip
        return cls(
            ctx=ctx,
            group=group,
            buddy=buddy_of[ctx.rank],
            wards=wards(buddy_of)[ctx.rank],
            pacer=RefreshPacer(
                fixed=spec.checkpoint.memory_every, checkpoint_every=spec.checkpoint.every_steps
            ),
            periodic=any(b is not None for b in buddy_of),
        )

    def after_step(
        self,
        copies: list[Snapshot],
        strategy: Strategy,
        step: int,
        step_s: float,
        *,
        final: bool = False,
    ) -> Snapshot | None:
        """Refresh `copies` (the process's list) when due after optimizer step `step`;
        `final`: the group stops now, hand the state on as it is. The snapshot made, if
        any."""
        if strategy.full_replica:
            return None  # every survivor holds the whole live state: nothing to copy
        if not (self.periodic or final):
            return None
        self.pacer.stepped(step_s)
        if not self.pacer.due(step, final=final):
            return None
        started = time.perf_counter()
        snapshot = self.refresh(copies, strategy, step)
        spent = time.perf_counter() - started
        if self.pacer.measures_next():
            # Every rank must choose the same interval: the group's slowest figures.
            agreed = torch.tensor([spent, self.pacer.mean_step_s()], dtype=torch.float64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
            self.pacer.refreshed(step, float(agreed[0]), float(agreed[1]))
        else:
            self.pacer.refreshed(step)
        self.stats.refreshes = self.pacer.refreshes
        self.stats.every = self.pacer.fixed or self.pacer.every
        self.stats.refresh_s, self.stats.step_s = self.pacer.refresh_s, self.pacer.step_s
        self.stats.held_bytes = sum(c.nbytes for c in copies)
        return snapshot

    def refresh(self, copies: list[Snapshot], strategy: Strategy, step: int) -> Snapshot:
        """Copy this rank's shard at `step`, send it to the buddy, receive the wards'."""
        rank = self.ctx.rank
        # Keep the newest whole generation; write into the buffers of another one.
        kept = next((c for c in reversed(copies) if c.whole), None)
        old = next((c for c in reversed(copies) if c is not kept), None)
        copies[:] = [kept] if kept is not None else []
        state = strategy.state_dict_for_checkpoint()
        if self._items is None:
            # The first refresh of the attempt plans, collectively, what each rank keeps
            # (by reference: nothing is copied yet) and so where it goes in its arena.
            writer = MemoryWriter(copy=False)
            metadata = state_dict_saver.save(state, storage_writer=writer, process_group=self.group)
            self._items, self._metadata = writer.items, metadata
            self._arenas = {r: arena_of(metadata, r) for r in (rank, *self.wards)}
        metadata = self._metadata
        assert metadata is not None
        arenas = {r: self._buffer(r, old) for r in self._arenas}
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, storage_meta=None, is_coordinator=False)
        own = keep_items(
            self._items, planner, into=self._views_of(rank, arenas[rank]), pickled=self._pickled
        )
        blobs = {rank: own}
        generation = Generation(self.ctx.attempt, step, self.ctx.world_size)
        try:
            self._exchange(own, arenas, blobs)
        finally:
            # Torn by a peer gone mid-exchange, it keeps what is whole: this rank's own
            # copy and each ward's that came in full. The lost rank's copy may have reached
            # its buddy before it went; the survivors' offers say which generations they
            # cover together (`sources.choose_source`), so this one is used only if whole.
            whole = set(blobs) == {rank, *self.wards}
            snapshot = Snapshot(generation, metadata, blobs, arenas, whole=whole)
            copies.append(snapshot)
            del copies[:-KEPT]
        return snapshot

    def _views_of(self, rank: int, buffer: torch.Tensor) -> Blob:
        key = (rank, buffer.data_ptr())
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 2 * KEPT * (1 + len(self.wards)):
                self._views.clear()  # buffers of an old layout: not to be kept alive
            views = self._views[key] = self._arenas[rank].views(buffer)
        return views

    def _buffer(self, rank: int, old: Snapshot | None) -> torch.Tensor:
        """The arena buffer for `rank`'s items: the older snapshot's when it fits."""
        nbytes = self._arenas[rank].nbytes
        buffer = old.arenas.get(rank) if old is not None else None
        if buffer is None or buffer.numel() != nbytes:
            # Pinned where a device copies into it, as an async save's staging buffers.
            buffer = arena_buffer(nbytes, pin=self.ctx.device.type != "cpu")
        return buffer

    def _exchange(self, own: Blob, arenas: dict[int, torch.Tensor], held: dict[int, Blob]) -> None:
        """Send `own` to the buddy and receive each ward's items into `held` (those that
        came in whole, even when the exchange then raises): first the sizes of the
        pickled items (they change), then the tensor arena and the pickled bytes."""
        rank = self.ctx.rank
        mine = self._arenas[rank]
        sizes = torch.tensor([own[i].numel() for i in mine.pickled], dtype=torch.int64)
        headers = {
            w: torch.empty(len(self._arenas[w].pickled), dtype=torch.int64) for w in self.wards
        }
        to_buddy = {self.buddy: [as_bytes(sizes)]} if self.buddy is not None else {}
        stream(to_buddy, {w: [as_bytes(h)] for w, h in headers.items()}, self.group)

        received: dict[int, Blob] = {}
        recvs: dict[int, list[torch.Tensor]] = {}
        for w in self.wards:
            arena = self._arenas[w]
            blob = dict(self._views_of(w, arenas[w]))
            pickled = [torch.empty(int(n), dtype=torch.uint8) for n in headers[w].tolist()]
            blob.update(zip(arena.pickled, pickled, strict=True))
            received[w] = blob
            recvs[w] = [arenas[w], *pickled]
        sends = (
            {self.buddy: [arenas[rank], *(own[i] for i in mine.pickled)]}
            if self.buddy is not None
            else {}
        )
        arrived: set[int] = set()
        try:
            self.stats.bytes_sent += stream(
                {k: [as_bytes(t) for t in v] for k, v in sends.items()},
                recvs,
                self.group,
                arrived=arrived,
            )
        finally:
            held.update((w, received[w]) for w in sorted(arrived))
