"""Tensors between ranks in buckets: what peer memory sends to a buddy and what a new
group fetches from the survivors. Never a pickled state: raw bytes, point to point.

Both sides of a pair know the byte size of every item, in order, so no header travels
with the data. `bucket_plan` cuts the items into messages of at most `bucket_bytes`: an
item of at least `direct_bytes` goes as its own message(s), bucket-sized slices of its
own bytes (no copy on either side); smaller items are packed together into one flat
buffer per message (one copy on each side, far fewer round trips than one message per
small tensor). All receives and sends
are posted at once (gloo's isend/irecv, each message under its own tag) and then waited
on, so pairs stream concurrently and nothing waits on a send that has no receiver yet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: The largest message: big enough that per-message costs vanish, small enough that the
#: packing buffers stay a small fraction of the state.
BUCKET_BYTES = 32 * 1024 * 1024
#: Items at least this large travel in messages of their own: copying them into a bucket
#: would cost more than the message (measured: packing 16 MB items halved the rate).
DIRECT_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes [start, stop) of item `item`."""

    item: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def bucket_plan(
    sizes: Sequence[int], bucket_bytes: int = BUCKET_BYTES, direct_bytes: int = DIRECT_BYTES
) -> list[list[Piece]]:
    """The messages that carry items of these byte sizes, in order: each a list of pieces.
    A message of one piece is sent from (received into) the item itself; a message of
    several is packed. Empty items travel in no message."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    direct_bytes = min(direct_bytes, bucket_bytes)
    messages: list[list[Piece]] = []
    packed: list[Piece] = []
    packed_size = 0
    for item, size in enumerate(sizes):
        if size == 0:
            continue
        if size >= direct_bytes:
            messages.extend(
                [Piece(item, start, min(start + bucket_bytes, size))]
                for start in range(0, size, bucket_bytes)
            )
            continue
        if packed_size + size > bucket_bytes:
            messages.append(packed)
            packed, packed_size = [], 0
        packed.append(Piece(item, 0, size))
        packed_size += size
    if packed:
        messages.append(packed)
    return messages


def stream(
    sends: Mapping[int, Sequence[torch.Tensor]],
    recvs: Mapping[int, Sequence[torch.Tensor]],
    group: dist.ProcessGroup | None,
    bucket_bytes: int = BUCKET_BYTES,
    *,
    arrived: set[int] | None = None,
) -> int:
    """Send `sends[peer]` (flat uint8 host tensors) to each peer and receive into
    `recvs[peer]` (flat uint8 host tensors of the sizes the peer sends) from each; group
    ranks. Returns the bytes moved (sent plus received).

    A peer whose connection has already closed fails as its messages are posted; the
    other peers' are posted and waited on regardless. On the first failed wait (a peer
    gone mid-exchange) it stops waiting: no further waiting on the dead (a cut-off peer's
    message would block until the attempt's release). Then it raises; first `arrived`,
    when given, gets each peer whose items all came in whole by then (its messages
    waited for, or already complete): what a torn exchange still delivered
    (`elastrain.workers.memory.snapshots`)."""
    works: list[tuple[int | None, dist.Work]] = []  # (the peer received from, or None)
    unpack: dict[int, list[tuple[torch.Tensor, list[Piece], Sequence[torch.Tensor]]]] = {}
    failed: set[int] = set()  # peers whose items did not all come
    error: BaseException | None = None
    moved = 0
    # Posting to a peer whose connection has closed raises at once (gloo): that peer's
    # part fails, the other peers' parts are still posted and waited on as usual.
    parts = [(peer, items, True) for peer, items in recvs.items()]
    parts += [(peer, items, False) for peer, items in sends.items()]
    for peer, items, receiving in parts:
        if receiving:
            unpack[peer] = []
        try:
            for tag, message in enumerate(bucket_plan([t.numel() for t in items], bucket_bytes)):
                if receiving:
                    buffer = _target(message, items)
                    work = dist.irecv(buffer, group=group, group_src=peer, tag=tag)
                else:
                    buffer = _source(message, items)
                    work = dist.isend(buffer, group=group, group_dst=peer, tag=tag)
                works.append((peer if receiving else None, _posted(work)))
                moved += buffer.numel()
                if receiving and len(message) > 1:
                    unpack[peer].append((buffer, message, items))
        except Exception as exc:
            error = error or exc
            if receiving:
                failed.add(peer)
    waiting = True  # until the first failed wait: then only what has completed already
    for source, work in works:
        if not waiting and not work.is_completed():
            if source is not None:  # not waited for: the exchange has failed already
                failed.add(source)
            continue
        try:
            work.wait()  # after a failure, only completed ones: returns (or raises) at once
        except Exception as exc:
            error, waiting = error or exc, False
            if source is not None:
                failed.add(source)
    if error is not None and arrived is None:
        raise error  # nobody asked what arrived: nothing to unpack
    for peer, packed in unpack.items():
        if peer in failed:
            continue
        for buffer, message, items in packed:
            offset = 0
            for piece in message:
                items[piece.item][piece.start : piece.stop].copy_(
                    buffer[offset : offset + piece.size]
                )
                offset += piece.size
        if arrived is not None:
            arrived.add(peer)
    if error is not None:
        raise error
    return moved


def _posted(work: dist.Work | None) -> dist.Work:
    # None only for a rank outside `group`, which a caller never is.
    assert work is not None, "this rank is not in the group"
    return work


def _source(message: list[Piece], items: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(message) == 1:
        p = message[0]
        return items[p.item][p.start : p.stop]
    return torch.cat([items[p.item][p.start : p.stop] for p in message])


def _target(message: list[Piece], items: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(message) == 1:
        p = message[0]
        return items[p.item][p.start : p.stop]
    return torch.empty(sum(p.size for p in message), dtype=torch.uint8)
