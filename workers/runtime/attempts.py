"""The runtime's one loop that moves every attempt through its phases.

No thread per attempt and no sleep per attempt: each driver (`elastrain.workers.runtime.driver`)
watches its outstanding object refs through futures whose completion callbacks (Ray's
core worker calls them the moment a reply arrives) wake this loop, as do a launch, a
release and every pool upkeep pass. Woken, the loop advances every attempt until none
moves (one attempt's processes coming back is what another waits for), then waits for the
next wake-up or the earliest timer an attempt set (a grace, a placement retry). A ready
reply therefore moves its attempt within milliseconds.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Protocol

log = logging.getLogger("elastrain.attempts")

#: Rounds of one pass at most: each round advances every attempt once; an attempt's step
#: can only unblock another's a few times over.
MAX_ROUNDS = 16
#: After a pass failed (a bug), the next one runs this soon even if nothing wakes the loop.
_AFTER_ERROR_S = 0.5


class Advancing(Protocol):
    def advance(self) -> bool:
        """Move on as far as the facts allow; whether anything changed."""
        ...

    @property
    def finished(self) -> bool:
        """Over, and nothing of it is out any more: the loop lets go of it."""
        ...

    @property
    def wake_at(self) -> float | None:
        """When it must be advanced though nothing happened (monotonic), or None."""
        ...


class AttemptLoop:
    def __init__(self) -> None:
        self._wakeups: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._attempts: list[Advancing] = []

    def start(self) -> None:
        threading.Thread(target=self._run, name="attempts", daemon=True).start()

    def add(self, attempt: Advancing) -> None:
        with self._lock:
            self._attempts.append(attempt)
        self.wake()

    def wake(self) -> None:
        """Something happened (any thread, a Ray callback too: it only queues)."""
        self._wakeups.put(None)

    def held(self) -> int:
        with self._lock:
            return len(self._attempts)

    def _run(self) -> None:
        while True:
            try:
                timeout = self.run_pass()
            except Exception:  # never let the one loop die: every attempt would stall
                log.exception("attempt loop")
                timeout = _AFTER_ERROR_S
            try:
                self._wakeups.get(timeout=timeout)
            except queue.Empty:
                continue
            while True:  # one pass answers every wake-up queued meanwhile
                try:
                    self._wakeups.get_nowait()
                except queue.Empty:
                    break

    def run_pass(self) -> float | None:
        """Advance every attempt until none moves (oldest first: one released frees the
        processes a newer one waits for); the seconds until the earliest timer."""
        for _ in range(MAX_ROUNDS):
            with self._lock:
                attempts = list(self._attempts)
            moved = False
            for attempt in attempts:
                try:
                    moved = attempt.advance() or moved
                except Exception:  # a driver's own bug: the others go on
                    log.exception("advancing an attempt")
            if not moved:
                break
        with self._lock:
            self._attempts = [a for a in self._attempts if not a.finished]
            timers = [t for a in self._attempts if (t := a.wake_at) is not None]
        return max(0.0, min(timers) - time.monotonic()) if timers else None
