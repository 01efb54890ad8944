"""Where a new group takes the job's state from: the pure decision.

Every rank of the new group offers what it holds of the job (`Offer`): a live state (the
model it trained in an earlier attempt, at the step that attempt reached) and snapshots
of shards (its own and its wards', `elastrain.workers.memory.snapshots`), each from one generation
(attempt, step, world size) of the group that made it. A generation can be loaded when
the group's offers together cover every rank of the group that saved it. The newest of
these, or a whole live replica (ddp), wins over a checkpoint that is not newer. Pure:
table-tested in tests/unit/test_peer_memory_rules.py.
"""

from __future__ import annotations

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
    """What one rank of the new group holds of the job."""

    live_step: int = NOTHING
    """Optimizer steps applied to the live state it keeps (how far its attempt got)."""
    full_replica: bool = False
    """The live state is the whole model and optimizer state (ddp)."""
    copies: tuple[tuple[Generation, frozenset[int]], ...] = ()
    """Snapshot generations it holds, each with the ranks (of the group that made it)
    whose items it holds."""


class Source(str, Enum):
    REPLICA = "replica"  # one survivor's live whole replica (ddp)
    SNAPSHOT = "snapshot"  # shards in survivors' memory (own and buddy copies)
    CHECKPOINT = "checkpoint"
    FRESH = "fresh"


@dataclass(frozen=True, slots=True)
class RestorePlan:
    source: Source
    step: int
    """The step restored (the newest checkpoint's as far as rank 0 knows, for CHECKPOINT)."""
    holder: dict[int, int] = field(default_factory=dict)
    """Rank of the saving group -> rank of the new group whose memory serves its items
    (REPLICA: {0: the donor})."""
    generation: Generation | None = None
    reached: int | None = None
    """The furthest step any survivor's attempt got to; None: no survivor says."""
    missing: tuple[int, ...] = ()
    """Ranks of the newest generation whose items no survivor holds (both the rank and
    its buddy were lost): why it fell back to a checkpoint."""

    @property
    def steps_recomputed(self) -> int | None:
        return None if self.reached is None else max(0, self.reached - self.step)

    @property
    def from_peers(self) -> bool:
        return self.source in (Source.REPLICA, Source.SNAPSHOT)


def choose_source(offers: Sequence[Offer], newest_checkpoint: int | None) -> RestorePlan:
    """The newest state the group can have: a survivor's whole live replica or a fully
    covered snapshot generation, unless the newest checkpoint is newer; then the
    checkpoint; else a fresh start. Ties go to memory (nothing read from storage)."""
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
    """The newest generation every rank of which some offer holds, with who serves what;
    and the ranks missing from the newest generation of all, if that one is not covered."""
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
    """Who serves each saved rank's items: of the ranks holding them, the one serving the
    fewest so far (ties: the lowest), so the hand-over streams from many ranks at once."""
    load: dict[int, int] = {}
    out: dict[int, int] = {}
    for old in sorted(by_rank):
        chosen = min(by_rank[old], key=lambda r: (load.get(r, 0), r))
        out[old] = chosen
        load[chosen] = load.get(chosen, 0) + 1
    return out
