"""The live tensors an in-place save writes, and handing them back to the update early.

An in-place save (`ShardedCheckpointer.save(in_place=True)`) writes the state's own
tensors from its background thread, so the caller's next update must not change one
before it is written. Waiting for the whole write holds that update for as long as the
write runs past the forward and backward: on a slow disk, or at an attempt's first save,
before any write was timed. `LiveTensors.take_back()` ends the wait sooner: the tensor
being written is finished, each tensor not yet written is copied (what a staging copy
would have done, for the rest only) and the writer goes on from the copies. So the update
waits for at most one tensor's write and a copy of what is left: nothing once the write
is over, never more than a staging copy of the whole state, and without the memory of
one for what was already written.

The writer claims the tensors one by one in the order it writes them (`claim`); a
writer that cannot (DCP's own write loop) says so (`unmanaged`) and the update then waits
for the whole write, as before. The save's thread says when the write ended, and how
(`write_ended`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from elastrain.checkpoints.dcp.host_memory import page_aligned_bytes
from elastrain.checkpoints.dcp.staging import ALIGNED_STAGING_MIN_BYTES


class LiveTensors:
    """The hand-over between an in-place save's writer (`register`, `claim`,
    `unmanaged`, `write_ended`) and the caller whose update needs the tensors back
    (`take_back`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._tensors: list[torch.Tensor] | None = None  # in write order, once registered
        self._next = 0  # the first tensor the writer has not claimed
        self._writing = False  # the writer reads a claimed tensor now
        # take_back() is waiting for the tensor being written: the writer claims no other
        # until the rest are copied (else it could take the lock back between two tensors
        # every time, and the update would wait for the whole write after all).
        self._taking_back = False
        self._unmanaged = False
        self._ended = False  # the save's data is written, or the write failed (`_error`)
        self._error: BaseException | None = None
        self.copied_bytes = 0
        """Bytes copied at `take_back` (the tensors not yet written then)."""

    # -- the writer's side ----------------------------------------------------------------

    def register(self, tensors: list[torch.Tensor]) -> None:
        """The tensors the writer will write, in that order (claimed one by one)."""
        with self._cond:
            self._tensors = list(tensors)
            self._cond.notify_all()

    def unmanaged(self) -> None:
        """The writer writes the live tensors without claims: the update waits for the
        whole write."""
        with self._cond:
            self._unmanaged = True
            self._cond.notify_all()

    def write_ended(self, error: BaseException | None = None) -> None:
        """The save's data is written (DCP's save returned), or the write failed."""
        with self._cond:
            self._ended, self._error = True, error
            self._cond.notify_all()

    @contextmanager
    def claim(self) -> Iterator[torch.Tensor]:
        """The next registered tensor (the live one, or its copy once taken back), not to
        be handed back to the update before the block ends."""
        with self._cond:
            assert self._tensors is not None, "claim() before register()"
            self._cond.wait_for(lambda: not self._taking_back)
            tensor = self._tensors[self._next]
            self._next += 1
            self._writing = True
        try:
            yield tensor
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()

    # -- the caller's side ----------------------------------------------------------------

    def take_back(self) -> None:
        """Return once the caller may change the live tensors: the write ended (a failed
        write's error is raised here), or the tensor being written is done and every one
        not yet written is a copy. Before the writer registered its tensors (it is still
        planning), this waits for that."""
        with self._cond:
            self._cond.wait_for(lambda: self._tensors is not None or self._unmanaged or self._ended)
            if self._tensors is not None and not self._unmanaged and not self._ended:
                self._taking_back = True
                try:
                    self._cond.wait_for(lambda: not self._writing)
                    for i in range(self._next, len(self._tensors)):
                        self._tensors[i] = _copy_of(self._tensors[i])
                        self.copied_bytes += self._tensors[i].nbytes
                finally:  # a failed copy (out of memory) raises here; the writer goes on
                    self._taking_back = False
                    self._cond.notify_all()
                return
            self._cond.wait_for(lambda: self._ended)
            if self._error is not None:
                raise self._error


def _copy_of(tensor: torch.Tensor) -> torch.Tensor:
    """A copy the shard writer writes as it would the tensor: a large contiguous one at a
    page-aligned address (written to the disk straight from there)."""
    if tensor.nbytes < ALIGNED_STAGING_MIN_BYTES or not tensor.is_contiguous():
        return tensor.clone()
    out = page_aligned_bytes(tensor.nbytes).view(tensor.dtype).view(tensor.shape)
    out.copy_(tensor)
    return out
