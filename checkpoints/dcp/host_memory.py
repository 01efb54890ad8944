"""Host buffers that direct I/O can write from: page-aligned, optionally pinned.

Torch's CPU allocator aligns to 64 bytes, and a shard file written with direct I/O
(`shard_file`) takes data straight from memory only at block-aligned addresses; from
anywhere else it copies the data through its bounce buffer first. The async save's
staging copies (`staging`) and peer memory's arenas (`in_memory`, which a checkpoint is
written from when peer memory made a copy at the same step) come from here.
"""

from __future__ import annotations

import logging
import mmap
import weakref

import torch

log = logging.getLogger("elastrain.checkpoints.host_memory")


def page_aligned_storage(nbytes: int, *, pin: bool = False) -> torch.UntypedStorage:
    """A CPU storage of `nbytes` at a page-aligned address (an anonymous mapping, freed
    with the storage). `pin`: registered with the device for its copies, as DCP pins its
    staging buffers; left unpinned, with a warning, where that fails (device copies
    are then slower and block; the data is the same)."""
    if nbytes == 0:
        return torch.UntypedStorage(0)
    storage = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).untyped_storage()
    if pin:
        try:
            _pin(storage)
        except RuntimeError as e:
            log.warning("host buffer of %d bytes not pinned: %s", nbytes, e)
    return storage


def page_aligned_bytes(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A flat uint8 tensor of `nbytes` over a `page_aligned_storage`."""
    storage = page_aligned_storage(nbytes, pin=pin)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _pin(storage: torch.UntypedStorage) -> None:
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.pin_memory(storage.data_ptr(), storage.nbytes())
    unpin = weakref.finalize(storage, _pin_memory_utils.unpin_memory, storage.data_ptr())
    unpin.atexit = False  # never after the CUDA context is gone
