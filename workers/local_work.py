"""The part of each step a rank does alone: getting its batch and updating its weights.

In a synchronous job every rank's step takes as long as the slowest rank's: forward and
backward meet the peers in collectives, so a fast rank's wall time includes waiting for a
slow one, and no rank's step time tells who is slow. What no peer paces is the work
before the step's first collective (its batch) and after the last (the optimizer's
update, local for every strategy: a replica, a shard or a stage). A slow GPU, a throttled
or contended CPU, a process slowed from outside, all make that work slower on that rank
alone; the runtime's straggler watch compares it across ranks
(`elastrain.workers.runtime.stragglers`).

The update is timed by the optimizer's own step hooks (`register_step_pre_hook`): on a
CPU with the wall clock, on a GPU with CUDA events read once they completed (a later
step), so timing adds no host wait.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch


class LocalWork:
    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._data_s = 0.0
        self._update_s: float | None = None
        self._started = 0.0
        self._events: deque[tuple[Any, Any]] = deque(maxlen=8)  # (start, end), pending
        self._hooks = [
            optimizer.register_step_pre_hook(self._before_update),
            optimizer.register_step_post_hook(self._after_update),
        ]

    def data(self, seconds: float) -> None:
        """This step's batch took `seconds`."""
        self._data_s += seconds

    def take(self) -> float | None:
        """The local seconds of the step just done (None until an update was timed), and
        start counting the next."""
        if self._cuda:
            self._read_events()
        update, data = self._update_s, self._data_s
        self._update_s, self._data_s = None, 0.0
        return None if update is None else data + update

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _before_update(self, *_: Any) -> None:
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, None))
        else:
            self._started = time.perf_counter()

    def _after_update(self, *_: Any) -> None:
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events[-1] = (self._events[-1][0], end)
        else:
            self._update_s = (self._update_s or 0.0) + time.perf_counter() - self._started

    def _read_events(self) -> None:
        """The newest update whose events completed (never waits for one that has not)."""
        while self._events and self._events[0][1] is not None and self._events[0][1].query():
            start, end = self._events.popleft()
            self._update_s = start.elapsed_time(end) / 1000.0
