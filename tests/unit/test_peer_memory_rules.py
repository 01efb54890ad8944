"""Peer memory's pure rules: who keeps whose copy, how often to refresh, which source a
new group restores from, and how bytes are cut into messages."""

from __future__ import annotations

import pytest

from elastrain.workers.memory.rules import (
    Generation,
    Offer,
    RefreshPacer,
    Source,
    buddies,
    choose_interval,
    choose_source,
    overhead,
    spread,
    wards,
)
from elastrain.workers.memory.transfer import Piece, bucket_plan


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        # Two even nodes: the same local index on the other node, both ways.
        (["a", "a", "b", "b"], [2, 3, 0, 1]),
        # Three nodes in a ring: a -> b -> c -> a.
        (["a", "a", "b", "b", "c", "c"], [2, 3, 4, 5, 0, 1]),
        # Uneven: the next node's ranks wrap around (rank 3 keeps three copies).
        (["a", "a", "a", "b"], [3, 3, 3, 0]),
        (["a", "b", "b", "b"], [1, 0, 0, 0]),
        # Ring order is the order nodes first appear, not their names.
        (["z", "z", "a", "a"], [2, 3, 0, 1]),
        # One rank per node.
        (["a", "b", "c"], [1, 2, 0]),
        # One node: no buddy possible for anyone; a single rank neither.
        (["a", "a", "a"], [None, None, None]),
        (["a"], [None]),
        ([], []),
    ],
)
def test_buddy_is_on_the_next_node(nodes: list[str], expected: list[int | None]) -> None:
    got = buddies(nodes)
    assert got == expected
    for rank, buddy in enumerate(got):
        assert buddy is None or nodes[buddy] != nodes[rank]  # never the same node


def test_wards_invert_buddies() -> None:
    assert wards([3, 3, 3, 0]) == [[3], [], [], [0, 1, 2]]
    assert wards([None, None]) == [[], []]


@pytest.mark.parametrize(
    ("refresh_s", "step_s", "expected"),
    [
        (0.0, 1.0, 1),  # free
        (0.01, 1.0, 1),  # 1 % of a step: every step
        (0.05, 1.0, 1),  # exactly the budget: every step
        (0.051, 1.0, 2),
        (0.1, 1.0, 2),
        (0.5, 1.0, 10),
        (1.0, 0.1, 200),
        (0.2, 0.0, 1),  # no step time measured yet: every step
    ],
)
def test_interval_is_the_smallest_within_budget(
    refresh_s: float, step_s: float, expected: int
) -> None:
    every = choose_interval(refresh_s, step_s)
    assert every == expected
    if step_s > 0:
        assert overhead(refresh_s, step_s, every) <= 0.05 + 1e-12
        if every > 1:
            assert overhead(refresh_s, step_s, every - 1) > 0.05


def test_pacer_measures_from_the_second_refresh_and_honours_a_fixed_interval() -> None:
    pacer = RefreshPacer()
    assert pacer.due(1)
    pacer.refreshed(1, refresh_s=9.0, step_s=1.0)  # the planning refresh: not counted
    assert pacer.every == 1 and pacer.due(2)
    pacer.refreshed(2, refresh_s=0.2, step_s=1.0)  # 20 % -> every 4 steps
    assert pacer.every == 4
    assert [s for s in range(3, 13) if pacer.due(s)] == [4, 8, 12]  # on its multiples
    assert pacer.due(3, final=True)  # a STOP refreshes at once
    pacer.refreshed(6, refresh_s=0.2, step_s=1.0)
    assert not pacer.due(6, final=True)  # already refreshed at this step

    for step in range(7, 12):
        pacer.refreshed(step, 0.01, 1.0)
    assert pacer.every == 1  # cheap now: every step

    fixed = RefreshPacer(fixed=3)
    fixed.refreshed(1, 0.0, 1.0)
    assert [s for s in range(2, 10) if fixed.due(s)] == [3, 6, 9]
    off = RefreshPacer(fixed=0)
    assert not off.due(1) and not off.due(5, final=True)


G = Generation


def copies(*held: tuple[Generation, set[int]]) -> tuple[tuple[Generation, frozenset[int]], ...]:
    return tuple((g, frozenset(r)) for g, r in held)


@pytest.mark.parametrize(
    ("offers", "checkpoint", "source", "step", "holder", "recomputed", "missing"),
    [
        # Node b (old ranks 2, 3) lost; 0 and 1 hold their own and b's copies.
        (
            [
                Offer(live_step=5, copies=copies((G(1, 5, 4), {0, 2}))),
                Offer(live_step=5, copies=copies((G(1, 5, 4), {1, 3}))),
            ],
            3, Source.SNAPSHOT, 5, {0: 0, 1: 1, 2: 0, 3: 1}, 0, (),
        ),
        # Old ranks 1 and 3 (buddies of each other) lost at once: back to storage.
        (
            [
                Offer(live_step=5, copies=copies((G(1, 5, 4), {0, 2}))),
                Offer(live_step=5, copies=copies((G(1, 5, 4), {2, 0}))),
            ],
            3, Source.CHECKPOINT, 3, {}, 2, (1, 3),
        ),
        # The newest generation was torn by the failure; the one before it is whole.
        (
            [
                Offer(live_step=6, copies=copies((G(1, 5, 2), {0, 1}), (G(1, 6, 2), {0}))),
                Offer(live_step=6, copies=copies((G(1, 5, 2), {1, 0}))),
            ],
            None, Source.SNAPSHOT, 5, {0: 0, 1: 1}, 1, (),
        ),
        # A checkpoint newer than memory wins; an equal one does not.
        (
            [Offer(live_step=4, copies=copies((G(1, 4, 1), {0})))],
            6, Source.CHECKPOINT, 6, {}, 0, (),
        ),
        (
            [Offer(live_step=4, copies=copies((G(1, 4, 1), {0})))],
            4, Source.SNAPSHOT, 4, {0: 0}, 0, (),
        ),
        # ddp: a whole live replica, newer than any snapshot; the lowest donor.
        (
            [Offer(), Offer(live_step=7, full_replica=True), Offer(live_step=7, full_replica=True)],
            5, Source.REPLICA, 7, {0: 1}, 0, (),
        ),
        # Fresh processes only: the checkpoint, nobody knows how far the job got.
        ([Offer(), Offer()], 5, Source.CHECKPOINT, 5, {}, None, ()),
        ([Offer(), Offer()], None, Source.FRESH, 0, {}, None, ()),
        # Generations of different attempts never mix.
        (
            [
                Offer(live_step=9, copies=copies((G(1, 5, 2), {0}))),
                Offer(live_step=9, copies=copies((G(2, 5, 2), {1}))),
            ],
            None, Source.FRESH, 0, {}, 9, (0,),  # the newer attempt lacks rank 0
        ),
    ],
)  # fmt: skip
def test_choose_source(
    offers: list[Offer],
    checkpoint: int | None,
    source: Source,
    step: int,
    holder: dict[int, int],
    recomputed: int | None,
    missing: tuple[int, ...],
) -> None:
    plan = choose_source(offers, checkpoint)
    assert (plan.source, plan.step, plan.holder) == (source, step, holder)
    assert plan.steps_recomputed == recomputed
    assert plan.missing == missing


def test_spread_balances_the_serving_ranks() -> None:
    # Every survivor holds everything: each serves one old rank's items.
    assert spread({0: [0, 1], 1: [0, 1], 2: [0, 1], 3: [0, 1]}) == {0: 0, 1: 1, 2: 0, 3: 1}


@pytest.mark.parametrize(
    ("sizes", "bucket", "expected"),
    [
        ([], 10, []),
        ([3, 4, 2], 10, [[Piece(0, 0, 3), Piece(1, 0, 4), Piece(2, 0, 2)]]),
        ([6, 6], 10, [[Piece(0, 0, 6)], [Piece(1, 0, 6)]]),
        # A large item goes in bucket-sized slices of its own; small ones around it pack.
        (
            [2, 25, 3, 0, 4],
            10,
            [[Piece(1, 0, 10)], [Piece(1, 10, 20)], [Piece(1, 20, 25)],
             [Piece(0, 0, 2), Piece(2, 0, 3), Piece(4, 0, 4)]],
        ),
        ([10], 10, [[Piece(0, 0, 10)]]),
    ],
)  # fmt: skip
def test_bucket_plan(sizes: list[int], bucket: int, expected: list[list[Piece]]) -> None:
    plan = bucket_plan(sizes, bucket, direct_bytes=bucket)
    assert plan == expected
    assert all(sum(p.size for p in m) <= bucket for m in plan)
    covered = sorted((p.item, p.start, p.stop) for m in plan for p in m)
    for item, size in enumerate(sizes):
        pieces = [(a, b) for i, a, b in covered if i == item]
        assert sum(b - a for a, b in pieces) == size


def test_items_past_the_direct_size_go_alone_without_packing() -> None:
    assert bucket_plan([2, 6, 3, 12], 10, direct_bytes=5) == [
        [Piece(1, 0, 6)], [Piece(3, 0, 10)], [Piece(3, 10, 12)], [Piece(0, 0, 2), Piece(2, 0, 3)]
    ]  # fmt: skip


def test_memory_every_is_validated() -> None:
    from pydantic import ValidationError

    from elastrain.contracts.spec import CheckpointSpec

    assert CheckpointSpec().memory_every is None  # measured by default
    assert CheckpointSpec(memory_every=0).memory_every == 0  # off
    with pytest.raises(ValidationError, match="memory_every"):
        CheckpointSpec(memory_every=-1)
