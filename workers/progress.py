"""How far a rank's training got, for the runtime's hang and straggler watches
(`elastrain.workers.runtime.hangs`, `elastrain.workers.runtime.stragglers`): the loop marks
what it is doing and each step it finishes, with the seconds of that step's local work
(`elastrain.workers.local_work`); the process answers the runtime's poll from another
thread with a snapshot, including where its training thread is stuck. Plain attribute writes: the poll may read a
phase a moment old, which a watch over seconds does not mind.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
import traceback
from collections import deque

from elastrain.contracts.group import RankProgress

#: Steps whose wall time makes the median a hang threshold scales with.
_RECENT_STEPS = 20
#: Frames of the training thread's stack a snapshot keeps (the innermost).
_FRAMES = 3
#: Steps whose local work a snapshot carries: at least the longest straggler window
#: (`failure.straggler_window`), plus slack for ranks a step apart when polled.
LOCAL_STEPS = 256


class Progress:
    def __init__(self) -> None:
        now = time.time()
        self.thread = threading.get_ident()
        self.step = 0
        self.steps_done = 0
        self.last_step_at = now
        self.phase = "start"
        self.phase_since = now
        self._recent: deque[float] = deque(maxlen=_RECENT_STEPS)
        self._local: deque[tuple[int, float]] = deque(maxlen=LOCAL_STEPS)

    def started(self, step: int) -> None:
        """The loop starts training from `step` (the restored one): the clock starts now."""
        self.step, self.steps_done, self.last_step_at = step, 0, time.time()
        self._recent.clear()
        self._local.clear()
        self.mark("start")

    def mark(self, phase: str) -> None:
        """The rank now does `phase` (`data`, `step`, `memory`, `checkpoint`, `eval`)."""
        self.phase, self.phase_since = phase, time.time()

    def stepped(self, step: int, local_s: float | None = None) -> None:
        """The rank finished `step`, whose local work took `local_s` (None: not known)."""
        now = time.time()
        if self.steps_done:
            self._recent.append(now - self.last_step_at)
        if local_s is not None:
            self._local.append((step, local_s))
        self.step, self.steps_done, self.last_step_at = step, self.steps_done + 1, now

    def snapshot(self) -> RankProgress:
        return RankProgress(
            step=self.step,
            last_step_at=self.last_step_at,
            steps_done=self.steps_done,
            phase=self.phase,
            phase_since=self.phase_since,
            median_step_s=statistics.median(self._recent) if self._recent else None,
            where=_where(self.thread),
            local=tuple(self._local),
        )


def _where(thread: int) -> str:
    frame = sys._current_frames().get(thread)
    if frame is None:
        return ""
    frames = traceback.extract_stack(frame)[-_FRAMES:]
    return " <- ".join(f"{f.filename}:{f.lineno} in {f.name}" for f in reversed(frames))
