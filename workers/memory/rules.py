"""Peer memory's pure rules.

`buddies`: each rank's copy is kept by a rank on ANOTHER node, so losing one node never
takes a shard and its only copy (Gemini, SOSP '23): the same local index on the next node
in ring order, wrapping on a node with fewer ranks. With one node there is no buddy (peer
memory then covers a resize STOP, not a node loss).

`RefreshPacer`: refresh every step when that costs at most 5 % of step time, else the
smallest interval that does, from the slowest rank's figures so all ranks refresh alike.

`choose_source`: each rank offers its live state and snapshot generations (`Offer`); a
generation loads when the offers cover every rank that saved it. The newest, or a whole
live replica (ddp), wins over a checkpoint that is not newer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

#: A step offered by a rank that holds nothing of the job.
NOTHING = -1


@dataclass(frozen=True, slots=True, order=True)
class Generation:
    """One refresh of peer memory by one group: its attempt, the step, the group size."""

    attempt: int
    step: int
    world_size: int


@dataclass(frozen=True, slots=True)
class Offer:
    live_step: int = NOTHING
    """Optimizer steps applied to the live state it keeps."""
    full_replica: bool = False
    """The live state is the whole model and optimizer state (ddp)."""
    copies: tuple[tuple[Generation, frozenset[int]], ...] = ()
    """Snapshot generations held, each with the saving ranks whose items it holds."""


class Source(str, Enum):
    REPLICA = "replica"  # one survivor's live whole replica (ddp)
    SNAPSHOT = "snapshot"  # shards in survivors' memory (own and buddy copies)
    CHECKPOINT = "checkpoint"
    FRESH = "fresh"


@dataclass(frozen=True, slots=True)
class RestorePlan:
    source: Source
    step: int
    holder: dict[int, int] = field(default_factory=dict)
    """Saving rank -> the new rank serving its items (REPLICA: {0: the donor})."""
    generation: Generation | None = None
    reached: int | None = None
    """The furthest step any survivor's attempt got to, if one says."""
    missing: tuple[int, ...] = ()
    """Ranks of the newest generation no survivor holds: why it fell back."""

    @property
    def steps_recomputed(self) -> int | None:
        return None if self.reached is None else max(0, self.reached - self.step)

    @property
    def from_peers(self) -> bool:
        return self.source in (Source.REPLICA, Source.SNAPSHOT)


def choose_source(offers: Sequence[Offer], newest_checkpoint: int | None) -> RestorePlan:
    """A live whole replica or covered snapshot generation, unless the newest checkpoint
    is newer; then the checkpoint; else a fresh start. Ties go to memory."""
    reached = max((o.live_step for o in offers if o.live_step > 0), default=None)
    candidates: list[RestorePlan] = []
    replicas = [
        (o.live_step, r) for r, o in enumerate(offers) if o.full_replica and o.live_step > 0
    ]
    if replicas:
        step = max(s for s, _ in replicas)
        donor = min(r for s, r in replicas if s == step)
        candidates.append(RestorePlan(Source.REPLICA, step, {0: donor}, reached=reached))
    snapshot, missing = _newest_covered(offers)
    if snapshot is not None:
        candidates.append(replace(snapshot, reached=reached))
    best = max(candidates, key=lambda p: (p.step, p.source == Source.REPLICA), default=None)
    if best is not None and (newest_checkpoint is None or best.step >= newest_checkpoint):
        return best
    if newest_checkpoint is not None:
        return RestorePlan(Source.CHECKPOINT, newest_checkpoint, reached=reached, missing=missing)
    return RestorePlan(Source.FRESH, 0, reached=reached, missing=missing)


def _newest_covered(offers: Sequence[Offer]) -> tuple[RestorePlan | None, tuple[int, ...]]:
    """The newest fully held generation, and the ranks missing from the newest of all."""
    held_by: dict[Generation, dict[int, list[int]]] = {}
    for new_rank, offer in enumerate(offers):
        for generation, ranks in offer.copies:
            by_rank = held_by.setdefault(generation, {})
            for old in ranks:
                by_rank.setdefault(old, []).append(new_rank)
    newest_missing: tuple[int, ...] = ()
    for i, generation in enumerate(
        sorted(held_by, key=lambda g: (g.step, g.attempt), reverse=True)
    ):
        by_rank = held_by[generation]
        missing = tuple(r for r in range(generation.world_size) if r not in by_rank)
        if missing:
            if i == 0:
                newest_missing = missing
            continue
        return RestorePlan(
            Source.SNAPSHOT, generation.step, spread(by_rank), generation=generation
        ), newest_missing
    return None, newest_missing


def spread(by_rank: dict[int, list[int]]) -> dict[int, int]:
    """Who serves each saved rank's items: the holder serving the fewest so far (ties:
    the lowest), so the hand-over streams from many ranks at once."""
    load: dict[int, int] = {}
    out: dict[int, int] = {}
    for old in sorted(by_rank):
        chosen = min(by_rank[old], key=lambda r: (load.get(r, 0), r))
        out[old] = chosen
        load[chosen] = load.get(chosen, 0) + 1
    return out


def buddies(nodes: Sequence[str]) -> list[int | None]:
    """`nodes[r]`: rank r's node. Each rank's buddy, on another node (None on one node)."""
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    ring = list(by_node)
    if len(ring) < 2:
        return [None] * len(nodes)
    out: list[int | None] = [None] * len(nodes)
    for i, node in enumerate(ring):
        following = by_node[ring[(i + 1) % len(ring)]]
        for local, rank in enumerate(by_node[node]):
            out[rank] = following[local % len(following)]
    return out


def wards(buddy_of: Sequence[int | None]) -> list[list[int]]:
    """For each rank, the ranks whose copy it keeps (ascending)."""
    out: list[list[int]] = [[] for _ in buddy_of]
    for rank, buddy in enumerate(buddy_of):
        if buddy is not None:
            out[buddy].append(rank)
    return out


OVERHEAD_BUDGET = 0.05
#: Measurements are smoothed so one slow step does not swing the interval.
SMOOTHING = 0.5


def choose_interval(refresh_s: float, step_s: float, budget: float = OVERHEAD_BUDGET) -> int:
    """The smallest k >= 1 with refresh_s / (k * step_s) <= budget."""
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got {budget}")
    if refresh_s <= 0 or step_s <= 0:
        return 1
    # A hair of tolerance: 0.05 / (0.05 * 1.0) must be 1, not 2, whatever the rounding.
    return max(1, math.ceil(refresh_s / (budget * step_s) * (1 - 1e-9)))


def overhead(refresh_s: float, step_s: float, every: int) -> float:
    """The share of training time taken by one refresh every `every` steps."""
    return refresh_s / (every * step_s) if step_s > 0 else 0.0


@dataclass
class RefreshPacer:
    """When to refresh. `fixed`: `checkpoint.memory_every` (0: never; None: measured,
    from the second refresh on: the first plans and allocates)."""

    fixed: int | None = None
    every: int = 1
    last: int | None = None
    refresh_s: float | None = None
    step_s: float | None = None
    refreshes: int = 0
    _step_times: list[float] = field(default_factory=list)

    def due(self, step: int, *, final: bool = False) -> bool:
        """Whether to refresh after step `step` (`final`: the group is about to stop)."""
        if self.fixed == 0:
            return False
        if final:
            return self.last != step
        interval = self.fixed if self.fixed is not None else self.every
        return self.last is None or step % interval == 0

    def stepped(self, seconds: float) -> None:
        self._step_times.append(seconds)

    def mean_step_s(self) -> float:
        """Mean step time since the last refresh."""
        times = self._step_times
        return sum(times) / len(times) if times else 0.0

    def refreshed(
        self, step: int, refresh_s: float | None = None, step_s: float | None = None
    ) -> None:
        """Record a refresh and, given measurements (the same on every rank), choose the
        next interval."""
        self.last = step
        self.refreshes += 1
        if refresh_s is None or step_s is None:
            return  # a fixed interval: nothing to choose
        self._step_times = []
        if self.refreshes == 1:
            return  # planning and allocation: not what later refreshes cost
        self.refresh_s = _smooth(self.refresh_s, refresh_s)
        if step_s > 0:
            self.step_s = _smooth(self.step_s, step_s)
        if self.fixed is None and self.step_s is not None:
            self.every = choose_interval(self.refresh_s, self.step_s)


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else SMOOTHING * old + (1 - SMOOTHING) * new
