"""Host buffers that direct I/O can write from: page-aligned, optionally pinned.

Torch's CPU allocator aligns to 64 bytes, and a shard file written with direct I/O
(`shard_file`) takes data straight from memory only at block-aligned addresses; from
anywhere else it copies the data through its bounce buffer first. The async save's
staging copies (`staging`) and peer memory's arenas (`in_memory`, which a checkpoint is
written from when peer memory made a copy at the same step) come from here, and both copy
into them with `copy_all`.
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


def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each source into its host target, all at once: host tensors in one
    `torch._foreach_copy_` (one call, the GIL released while it copies, where a loop
    takes it back between tensors); device tensors with non-blocking copies queued on the
    current stream, after the work already queued there, and one wait for the last (a
    blocking copy per tensor waits for the device once per tensor)."""
    on_host = [i for i, s in enumerate(sources) if s.device.type == "cpu"]
    if len(on_host) == len(sources):
        if targets:
            torch._foreach_copy_(targets, sources)
        return
    for i in on_host:
        targets[i].copy_(sources[i])
    devices = set()
    for target, source in zip(targets, sources, strict=True):
        if source.device.type != "cpu":
            target.copy_(source, non_blocking=True)
            devices.add(source.device)
    for device in devices:
        copied = torch.Event(device=device)
        copied.record(torch.accelerator.current_stream(device))
        copied.synchronize()
