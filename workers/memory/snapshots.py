"""Peer memory's refresh: every rank copies its shard to host memory and sends it to its
buddy on another node (`rules`).

A snapshot is an in-memory DCP checkpoint (`in_memory`): the items DCP's save planner says
this rank writes, as an async save would stage them. The first refresh of an attempt
plans collectively; later ones reuse the plan and only copy. The buddy copy goes over a
gloo group of its own (`transfer`): the sizes of the pickled items, then raw bytes.

Two generations are kept: a refresh writes into the older one's buffers and keeps the
newest whole one, which a refresh torn by a failure leaves whole on every rank. The torn
one keeps what is whole of it (own copy, wards' that came in full): a dead node's copies
may have reached their buddies, and `rules.choose_source` uses it if the survivors'
copies cover it.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem

from elastrain.contracts.spec import JobSpec
from elastrain.workers.api import TrainContext
from elastrain.workers.comm_release import group_forming
from elastrain.workers.memory.in_memory import (
    Blob,
    Layout,
    MemoryWriter,
    PickleCache,
    as_bytes,
    held_blob,
    held_items,
)
from elastrain.workers.memory.rules import Generation, RefreshPacer, buddies, overhead, wards
from elastrain.workers.memory.transfer import stream
from elastrain.workers.strategies import Strategy

log = logging.getLogger("elastrain.workers.memory")

#: Generations kept: the newest whole one, and the one being written.
KEPT = 2
#: Tensor items start at multiples of this in their flat buffer.
ALIGN = 64


@dataclass
class Snapshot:
    """One generation held here: items of the ranks in `blobs` (own, wards'), and the
    metadata of the whole in-memory checkpoint."""

    generation: Generation
    metadata: Metadata
    blobs: dict[int, Blob]
    flat: dict[int, torch.Tensor]
    """Per rank, the buffer its tensor items are views of."""
    whole: bool = True
    """Every ward's copy came in (False: a torn refresh)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.blobs.values() for t in b.values())


@dataclass
class PeerRefresher:
    """One attempt's refreshes on one rank; every rank calls `after_step` after every
    optimizer step (refreshes are collective)."""

    ctx: TrainContext
    group: dist.ProcessGroup
    buddy: int | None
    wards: list[int]
    pacer: RefreshPacer
    periodic: bool = True
    """Off when all ranks share a node: no copy can outlive a node loss then, and a
    resize STOP refreshes at its step anyway."""
    _items: list[WriteItem] | None = None
    _metadata: Metadata | None = None
    _held: dict[int, list[tuple[MetadataIndex, Layout]]] = field(default_factory=dict)
    _pickled: PickleCache = field(default_factory=dict)

    @classmethod
    def join(cls, ctx: TrainContext, spec: JobSpec) -> PeerRefresher:
        """Collective: a gloo group for peer memory (host tensors) and every rank's node."""
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
            pacer=RefreshPacer(fixed=spec.checkpoint.memory_every),
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
        """Refresh `copies` (the process's list) when due after step `step` (`final`: the
        group stops now); the snapshot made, if any."""
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
        if self.pacer.fixed is None:  # every rank chooses from the slowest's figures
            agreed = torch.tensor([spent, self.pacer.mean_step_s()], dtype=torch.float64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
            self.pacer.refreshed(step, float(agreed[0]), float(agreed[1]))
        else:
            self.pacer.refreshed(step)
        return snapshot

    def describe(self, copies: list[Snapshot]) -> str:
        """What this attempt's refreshes cost, for the log."""
        pacer = self.pacer
        every = pacer.fixed or pacer.every
        cost = ""
        if pacer.refresh_s is not None and pacer.step_s is not None:
            share = overhead(pacer.refresh_s, pacer.step_s, every)
            cost = f", {pacer.refresh_s * 1e3:.1f} ms each = {share:.1%} of step time"
        held = sum(c.nbytes for c in copies) / 1e6
        return f"{pacer.refreshes} refreshes, every {every} step(s){cost}, {held:.1f} MB held"

    def refresh(self, copies: list[Snapshot], strategy: Strategy, step: int) -> Snapshot:
        """Copy this rank's shard at `step`, send it to the buddy, receive the wards'."""
        rank = self.ctx.rank
        # Keep the newest whole generation; write into the buffers of another one.
        kept = next((c for c in reversed(copies) if c.whole), None)
        old = next((c for c in reversed(copies) if c is not kept), None)
        copies[:] = [kept] if kept is not None else []
        state = strategy.state_dict_for_checkpoint()
        if self._items is None:
            # The attempt's first refresh plans collectively what each rank keeps.
            writer = MemoryWriter()
            metadata = state_dict_saver.save(state, storage_writer=writer, process_group=self.group)
            self._items, self._metadata = writer.items, metadata
            self._held = {r: held_items(metadata, r) for r in (rank, *self.wards)}
        metadata = self._metadata
        assert metadata is not None
        if old is not None and old.metadata is not metadata:
            old = None  # another attempt's layout: no buffer of it fits
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, storage_meta=None, is_coordinator=False)
        live = held_blob(self._items, planner, self._pickled)
        flat = {r: self._buffers(r, old) for r in (rank, *self.wards)}
        own = dict(flat[rank][1])
        _copy(list(own.values()), [live[i] for i in own])
        own.update((i, raw) for i, raw in live.items() if i not in own)  # the pickled bytes
        blobs = {rank: own}
        generation = Generation(self.ctx.attempt, step, self.ctx.world_size)
        try:
            self._exchange(own, flat, blobs)
        finally:
            # Torn, it keeps what is whole: own copy and each ward's that came in full.
            whole = set(blobs) == {rank, *self.wards}
            buffers = {r: buffer for r, (buffer, _) in flat.items()}
            snapshot = Snapshot(generation, metadata, blobs, buffers, whole=whole)
            copies.append(snapshot)
            del copies[:-KEPT]
        return snapshot

    def _buffers(self, rank: int, old: Snapshot | None) -> tuple[torch.Tensor, Blob]:
        """One flat host buffer for rank `rank`'s tensor items, and the items as views of
        it: they travel as one message, unpacked (a small gpt's fsdp refresh: 27-36 ms so,
        47-68 ms packed). The older generation's buffer when it fits, else a new one
        (pinned for this rank's own where a device copies into it)."""
        layouts = [(i, layout) for i, layout in self._held[rank] if layout is not None]
        sizes = [shape.numel() * dtype.itemsize for _, (dtype, shape) in layouts]
        starts = [0]
        for size in sizes:  # each item's start aligned for a view of any dtype
            starts.append(starts[-1] + -(-size // ALIGN) * ALIGN)
        buffer = old.flat.get(rank) if old is not None else None
        if buffer is None or buffer.numel() != starts[-1]:
            pin = rank == self.ctx.rank and self.ctx.device.type != "cpu"
            buffer = torch.empty(starts[-1], dtype=torch.uint8, pin_memory=pin)
        views = {
            index: buffer[start : start + size].view(dtype).view(shape)
            for (index, (dtype, shape)), start, size in zip(
                layouts, starts[:-1], sizes, strict=True
            )
        }
        return buffer, views

    def _exchange(
        self, own: Blob, flat: dict[int, tuple[torch.Tensor, Blob]], held: dict[int, Blob]
    ) -> None:
        """Send `own` to the buddy and receive each ward's items into `held` (those whole,
        even when the exchange raises): the pickled items' sizes (they change), then the
        flat buffer and the pickled bytes, in `held_items` order."""
        mine = self._held[self.ctx.rank]
        sizes = torch.tensor(
            [own[i].numel() for i, layout in mine if layout is None], dtype=torch.int64
        )
        headers = {
            w: torch.empty(sum(layout is None for _, layout in self._held[w]), dtype=torch.int64)
            for w in self.wards
        }
        to_buddy = {self.buddy: [as_bytes(sizes)]} if self.buddy is not None else {}
        stream(to_buddy, {w: [as_bytes(h)] for w, h in headers.items()}, self.group)

        received: dict[int, Blob] = {}
        recvs: dict[int, list[torch.Tensor]] = {}
        for w in self.wards:
            pickled = [i for i, layout in self._held[w] if layout is None]
            bytes_of = [torch.empty(n, dtype=torch.uint8) for n in headers[w].tolist()]
            received[w] = {**flat[w][1], **dict(zip(pickled, bytes_of, strict=True))}
            recvs[w] = [flat[w][0], *bytes_of]
        own_pickled = [own[i] for i, layout in mine if layout is None]
        sends = {}
        if self.buddy is not None:
            sends[self.buddy] = [flat[self.ctx.rank][0], *own_pickled]
        arrived: set[int] = set()
        try:
            stream(sends, recvs, self.group, arrived=arrived)
        finally:
            held.update((w, received[w]) for w in sorted(arrived))


def _copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy sources into host targets in one `torch._foreach_copy_` (GIL released: 0.6 ms
    for 108 items where a loop of `copy_` took 2.0 ms); from a device, non-blocking, then
    one wait for all."""
    on_device = any(s.device.type != "cpu" for s in sources)
    if targets:
        torch._foreach_copy_(targets, sources, non_blocking=on_device)
    if on_device:
        torch.accelerator.synchronize()
