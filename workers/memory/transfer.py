"""Tensors between ranks in buckets, as raw bytes point to point, never pickled.

Both sides know every item's byte size, so no header travels. `bucket_plan` cuts items
into messages of at most `bucket_bytes`: a large item goes as slices of its own bytes
(no copy), small ones are packed into one buffer per message (far fewer round trips).
All receives and sends are posted at once, each under its own tag, then waited on, so
pairs stream concurrently and no send waits for a receiver.
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
    """The messages carrying items of these byte sizes, in order. A message of one piece
    is sent from (received into) the item itself; one of several is packed."""
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
    """Send `sends[peer]` and receive into `recvs[peer]` (flat uint8 host tensors; group
    ranks); returns the bytes moved. A failure to post fails that peer only. After the
    first failed wait it waits no more (a cut-off peer would block until the attempt's
    release) and raises, once `arrived` (if given) has every peer whose items all came
    in whole: what a torn exchange still delivered."""
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
                buffer = _buffer(message, items, receiving=receiving)
                if receiving:
                    work = dist.irecv(buffer, group=group, group_src=peer, tag=tag)
                else:
                    work = dist.isend(buffer, group=group, group_dst=peer, tag=tag)
                assert work is not None  # None only for a rank outside `group`
                works.append((peer if receiving else None, work))
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


def _buffer(
    message: list[Piece], items: Sequence[torch.Tensor], *, receiving: bool
) -> torch.Tensor:
    """A one-piece message's item slice itself, else a packed buffer (empty to receive)."""
    if len(message) == 1:
        p = message[0]
        return items[p.item][p.start : p.stop]
    if receiving:
        return torch.empty(sum(p.size for p in message), dtype=torch.uint8)
    return torch.cat([items[p.item][p.start : p.stop] for p in message])
