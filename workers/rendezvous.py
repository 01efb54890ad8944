"""The TCPStore a process group forms around, opened where its port cannot be lost.

A port found free and bound only later (when rank 0 starts) can be taken in between, by
one of the collectives' own connections among others: they use the same ephemeral range.
A store hosted with port 0 listens from the moment its port (`store.port`) is known.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def host_store(host: str, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The store's server, listening now on a port the OS picked (`.port`); it does not
    wait for the `world_size` ranks to connect (they connect as clients when they start)."""
    return dist.TCPStore(
        host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout
    )
