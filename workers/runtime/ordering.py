"""Rank 0's batches back in the order they were sent.

The runtime actor is threaded (`max_concurrency`), and Ray runs a threaded actor's calls
in no guaranteed order, even calls from one caller: two of rank 0's `push_many` calls in
flight at once can run in either order. Seen in CI: the batch holding an attempt's first
step ran before the one holding its STATE_RESTORED mark, so the attempt's timeline went out
without its restore. Rank 0 numbers its batches; the driver applies them by number.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

T = TypeVar("T")

#: The most batches held back waiting for an earlier one. A batch goes missing only when
#: the runtime actor dies with it in flight (its drivers die too); this bounds memory if
#: that assumption ever breaks, at the cost of order, never of the messages.
MAX_HELD = 256


class InOrder(Generic[T]):
    """Releases numbered batches (0, 1, 2, ...) in number order, whatever order they come in."""

    def __init__(self, *, max_held: int = MAX_HELD) -> None:
        self.next = 0
        self._held: dict[int, Sequence[T]] = {}
        self._max_held = max_held

    def add(self, number: int, batch: Sequence[T]) -> list[T]:
        """The items now due, in order: `batch` and any held ones it was the gap before
        (nothing if an earlier batch is still to come). A number seen before is dropped."""
        if number < self.next or number in self._held:
            return []
        self._held[number] = batch
        if len(self._held) > self._max_held:
            self.next = min(self._held)  # the gap is not coming: go on without it
        out: list[T] = []
        while self.next in self._held:
            out.extend(self._held.pop(self.next))
            self.next += 1
        return out
