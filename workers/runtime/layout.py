"""Which process gets which rank: node by node, so that the groups that talk most stay
inside a node.

Ranks are numbered tensor-parallel innermost, then pipeline stage, then replica
(`elastrain.workers.strategies.mesh`): a tensor-parallel group is `tp` consecutive ranks and a model
replica `tp * stages`. The processes of an attempt sit on whatever nodes its placement
group got; `rank_order` numbers them so that a whole replica, else a whole tensor-parallel
group, lies on one node wherever the per-node counts allow it, and so that rank 0 is a
process holding the job's newest state when one does. Pure: table-tested in
tests/unit/test_rank_layout.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Slot:
    """One process of the attempt: its node and how new a state of the job it holds."""

    node: str
    held_step: int | None = None
    """The step of the job's state it holds (None: none)."""


def rank_order(slots: Sequence[Slot], *, group_sizes: Sequence[int] = ()) -> list[int]:
    """Indices into `slots`, in rank order.

    `group_sizes`: the blocks to keep within a node, outermost first (a replica of
    `tp * stages` ranks, then a tensor-parallel group of `tp`); sizes of 1 are ignored.
    Whole blocks are cut from each node first (nodes holding the newest state first,
    then the most populous), and what is left on the nodes fills the remaining blocks
    node by node, so a block spans nodes only when no node has room for it.
    """
    by_node: dict[str, list[int]] = {}
    for i, slot in enumerate(slots):
        by_node.setdefault(slot.node, []).append(i)
    for members in by_node.values():  # holders of the newest state first within a node
        members.sort(key=lambda i: _freshness(slots[i]), reverse=True)
    nodes = sorted(
        by_node,
        key=lambda n: (max(_freshness(slots[i]) for i in by_node[n]), len(by_node[n])),
        reverse=True,
    )
    sizes = [s for s in group_sizes if s > 1]
    return _cut(nodes, by_node, sizes)


def _cut(nodes: list[str], by_node: dict[str, list[int]], sizes: list[int]) -> list[int]:
    if not sizes:
        return [i for n in nodes for i in by_node[n]]
    size, inner = sizes[0], sizes[1:]
    whole: list[int] = []
    rest: dict[str, list[int]] = {}
    for node in nodes:
        members = by_node[node]
        fits = len(members) // size * size
        whole += members[:fits]
        if fits < len(members):
            rest[node] = members[fits:]
    # What is left, node by node: the blocks made of it span nodes (no node had room),
    # but their inner groups may still each fit in one.
    return whole + _cut([n for n in nodes if n in rest], rest, inner)


def _freshness(slot: Slot) -> int:
    return -1 if slot.held_step is None else slot.held_step


def local_layout(nodes: list[str]) -> list[dict[str, Any]]:
    """Per rank (ranks numbered node by node): its LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK
    (the node's index, in order of first rank) and GROUP_WORLD_SIZE."""
    order: dict[str, int] = {}
    for node in nodes:
        order.setdefault(node, len(order))
    seen: dict[str, int] = {}
    out = []
    for node in nodes:
        out.append(
            {
                "local_rank": seen.get(node, 0),
                "local_world_size": nodes.count(node),
                "group_rank": order[node],
                "group_world_size": len(order),
            }
        )
        seen[node] = seen.get(node, 0) + 1
    return out
