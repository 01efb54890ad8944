"""Who keeps a copy of whose state: each rank's buddy is a rank on ANOTHER node, so that
losing one node never takes a shard and its only copy (Gemini, SOSP '23).

Nodes are taken in ring order (the order their first rank appears: the runtime numbers
ranks node by node, `elastrain.workers.runtime.layout`). A rank's buddy is the rank at the same
local index on the next node of the ring; where that node has fewer ranks (uneven
nodes), the index wraps around its ranks, so one rank may keep several copies. With one
node there is no buddy to be had: peer memory then covers a resize STOP (every rank
survives) but not a node loss. Pure: table-tested in tests/unit/test_peer_memory_rules.py.
"""

from __future__ import annotations

from collections.abc import Sequence


def buddies(nodes: Sequence[str]) -> list[int | None]:
    """`nodes[r]`: the node of rank r. Returns, for each rank, the rank that keeps a copy
    of its state (always on another node), or None for every rank when all share a node."""
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
