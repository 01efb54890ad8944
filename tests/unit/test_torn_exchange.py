"""A peer-memory exchange torn by a peer gone mid-way still delivers what came in whole:
`stream` waits for every message, says which peers' items all arrived, then raises. A
refresh keeps those copies (`elastrain.workers.memory.snapshots`), so when a node dies after
its ranks' copies reached their buddies, the survivors still hold the newest step.

Real gloo processes: rank 0 receives items from ranks 1 and 2 and sends to rank 1; rank 1
does its whole part and ends; rank 2 joins the group and ends without sending (its node
died), before rank 0 posts its messages (gloo refuses the post) or while rank 0 waits."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastrain.workers.memory.transfer import stream
from tests.unit.dist_utils import run_distributed

SIZES = [3, 2_000_000, 5]  # a packed message and a direct one
BUCKET = 1_000_000  # the big item in two messages (both sides cut alike)


def items(rank: int) -> list[torch.Tensor]:
    return [torch.full((n,), rank, dtype=torch.uint8) for n in SIZES]


def body(rank: int, world_size: int, gone_before_posting: bool) -> Any:
    if rank == 2:
        if not gone_before_posting:
            time.sleep(1.0)  # rank 0 is waiting on its messages by now
        os._exit(0)  # gone before sending its items
    if rank == 1:
        into = [torch.zeros(n, dtype=torch.uint8) for n in SIZES]
        stream({0: items(1)}, {0: into}, None, bucket_bytes=BUCKET)
        assert all(bool((t == 0).all()) for t in into)  # rank 0's items, whole
        dist.distributed_c10d._get_default_store().set("rank1-took-its-items", "1")
        os._exit(0)  # gone after its exchange: its connections close
    into = {peer: [torch.zeros(n, dtype=torch.uint8) for n in SIZES] for peer in (1, 2)}
    arrived: set[int] = set()
    if gone_before_posting:
        time.sleep(1.0)  # rank 2's connection has closed by now
    try:
        stream({1: items(0)}, into, None, bucket_bytes=BUCKET, arrived=arrived)
    except Exception as exc:  # rank 2's items never come: its connection closed
        error = type(exc).__name__
    else:
        error = None
    whole = all(bool((t == 1).all()) for t in into[1])
    # A torn exchange stops waiting on its own sends, so rank 1 may still be reading rank
    # 0's: the group stays up until it has (tearing it down would cut rank 1 off mid-read).
    dist.distributed_c10d._get_default_store().wait(["rank1-took-its-items"])
    # The survivor goes on alone (run_distributed's closing barrier is on the new group).
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return {"error": error, "arrived": arrived, "whole_from_1": whole}


@pytest.mark.parametrize("gone_before_posting", [True, False], ids=["before-posting", "mid-wait"])
def test_a_torn_exchange_says_which_peers_items_came_in_whole(gone_before_posting: bool) -> None:
    (out, _, _) = run_distributed(
        body, 3, gone_before_posting, timeout_s=180, pg_timeout_s=30, may_exit=True
    )
    assert out["error"] is not None  # the exchange failed: rank 2 never sent
    assert out["arrived"] == {1}  # ... but rank 1's items all came, and are whole
    assert out["whole_from_1"]


class Shard:
    """A strategy as a refresh sees it: a state dict of this rank's tensors."""

    full_replica = False

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        # Big enough that a send to a peer that stops reading cannot sit in socket buffers.
        return {f"w{self.rank}": torch.full((SHARD_BYTES,), self.step, dtype=torch.uint8)}


SHARD_BYTES = 24_000_000


def torn_refresh(rank: int, world_size: int, lost_sends: bool) -> Any:
    """Nodes a, b, b: rank 0's buddy is 1, ranks 1 and 2 keep their copies on rank 0. Step
    1 refreshes whole; in step 2's exchange node b goes: its ranks send their copies (or
    not: `lost_sends` False) and end without taking rank 0's."""
    from pathlib import Path

    import elastrain.workers.memory.snapshots as snapshots
    from elastrain.workers.api import TrainContext
    from elastrain.workers.memory.rules import Offer, choose_source
    from elastrain.workers.memory.snapshots import PeerRefresher
    from tests.unit.test_peer_memory import spec_for

    ctx = TrainContext(rank=rank, world_size=world_size, local_rank=rank, job_id=1, attempt=1,
                       device=torch.device("cpu"), checkpoint_root=Path("/nonexistent"),
                       node="ab"[min(rank, 1)])  # fmt: skip
    peers = PeerRefresher.join(ctx, spec_for({"kind": "fsdp"}))
    copies: list[Any] = []
    peers.refresh(copies, Shard(rank, 1), step=1)
    if rank > 0:
        real, calls = snapshots.stream, []

        def dying(sends: Any, recvs: Any, group: Any, *a: Any, **kw: Any) -> int:
            calls.append(1)
            if len(calls) == 1:  # the sizes' header goes as usual
                return real(sends, recvs, group, *a, **kw)
            if lost_sends:
                real(sends, {}, group)  # this rank's copy goes out, nothing is taken in
                time.sleep(2.0)  # ... and is read by rank 0 before the node goes
            os._exit(0)

        snapshots.stream = dying  # type: ignore[assignment]
        peers.refresh(copies, Shard(rank, 2), step=2)
    try:
        peers.refresh(copies, Shard(rank, 2), step=2)
        error = None
    except Exception as exc:
        error = type(exc).__name__
    plan = choose_source([Offer(live_step=2, copies=tuple(
        (c.generation, frozenset(c.blobs)) for c in copies))], newest_checkpoint=None)  # fmt: skip
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return {
        "error": error,
        "kept": [(c.generation.step, sorted(c.blobs), c.whole) for c in copies],
        "restored": (plan.source.value, plan.step),
        "ward_bytes": {r: _bytes_of(blob) for r, blob in copies[-1].blobs.items()},
    }


def _bytes_of(blob: dict[Any, torch.Tensor]) -> set[int]:
    """The byte values of a held copy's big tensor item (a rank's shard is all one value)."""
    (big,) = [t for t in blob.values() if t.numel() >= SHARD_BYTES]
    return set(big.unique().tolist())


@pytest.mark.parametrize("lost_sends", [True, False], ids=["copies-arrived", "copy-lost"])
def test_a_torn_refresh_keeps_what_came_and_restores_the_newest_covered_step(
    lost_sends: bool,
) -> None:
    (out, _, _) = run_distributed(
        torn_refresh, 3, lost_sends, timeout_s=300, pg_timeout_s=30, may_exit=True
    )
    assert out["error"] is not None  # rank 0's own send to its buddy failed
    if lost_sends:
        # Node b's copies reached rank 0 before it went: step 2 is whole here, no step lost.
        assert out["kept"] == [(1, [0, 1, 2], True), (2, [0, 1, 2], True)]
        assert out["restored"] == ("snapshot", 2)
        assert out["ward_bytes"] == {0: {2}, 1: {2}, 2: {2}}
    else:
        # Nothing of step 2 came: kept for what it has, but step 1 (whole) is what restores.
        assert out["kept"] == [(1, [0, 1, 2], True), (2, [0], False)]
        assert out["restored"] == ("snapshot", 1)
