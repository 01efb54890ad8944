"""Ranks are numbered node by node (`elastrain.workers.runtime.layout.rank_order`): a replica, else a
tensor-parallel group, spans nodes only when no node has room for it."""

from __future__ import annotations

import pytest

from elastrain.workers.runtime.layout import Slot, rank_order


def nodes_of(slots: list[Slot], order: list[int]) -> list[str]:
    return [slots[i].node for i in order]


def groups_spanning(nodes: list[str], size: int) -> int:
    return sum(len(set(nodes[i : i + size])) > 1 for i in range(0, len(nodes), size))


@pytest.mark.parametrize(
    ("placed", "sizes", "expected"),
    [
        # interleaved bundles, tp=2: each tp pair on one node
        ("ABAB", (2, 2), "AABB"),
        # replicas of 4 (tp 2 x 2 stages) on nodes of 4: whole replicas per node
        ("ABABABAB", (4, 2), "AAAABBBB"),
        # 3 + 3 + 2 processes, tp=2: pairs inside nodes, the two leftovers pair up last
        ("AABBCABC", (2, 2), "AABBCCAB"),
        # replicas of 4 (tp 2 x 2 stages) on 3 + 3 + 2: no node holds a replica; tp pairs
        # still each on one node but one
        ("ABCABCAB", (4, 2), "AABBCCAB"),
        # ddp/fsdp (no groups): node by node, the most populous node first
        ("ABBCB", (1, 1), "BBBAC"),
    ],
)
def test_rank_order_keeps_groups_inside_nodes(
    placed: str, sizes: tuple[int, int], expected: str
) -> None:
    slots = [Slot(node) for node in placed]
    order = rank_order(slots, group_sizes=sizes)
    assert sorted(order) == list(range(len(slots)))  # a permutation
    assert "".join(nodes_of(slots, order)) == expected


def test_spanning_groups_are_the_fewest_the_counts_allow() -> None:
    # 8 processes on nodes of 3, 3 and 2, tp=2: one pair must span two nodes
    slots = [Slot(n) for n in "ABCABCAB"]
    nodes = nodes_of(slots, rank_order(slots, group_sizes=(2,)))
    assert groups_spanning(nodes, 2) == 1
    # in the order the bundles came, every pair spanned
    assert groups_spanning([s.node for s in slots], 2) == 4


def test_holders_of_the_newest_state_come_first() -> None:
    slots = [Slot("A"), Slot("B", held_step=7), Slot("A"), Slot("B", held_step=9)]
    order = rank_order(slots, group_sizes=(2,))
    # node B holds the newest state: its pair is ranks 0-1, the newest holder rank 0
    assert order == [3, 1, 0, 2]


def test_a_group_bigger_than_every_node_still_gets_every_rank() -> None:
    slots = [Slot(n) for n in "ABCD"]
    order = rank_order(slots, group_sizes=(4, 4))
    assert sorted(order) == [0, 1, 2, 3]
