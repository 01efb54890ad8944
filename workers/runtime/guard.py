"""Refusing calls that carry no valid capability (`elastrain.contracts.capability`), and
saying so in the log without letting a caller flood it.

A refused call raises `Refused` to its caller (a call made with `.remote()` and never
waited for refuses silently on that side), and is logged with what the caller claimed
(the method, the attempt key it named): the first refusal of a kind at once, then at
most one line per `interval_s` with how many were refused meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("elastrain.guard")

#: One log line per kind of refusal at most this often.
REFUSAL_LOG_INTERVAL_S = 10.0


class Refused(PermissionError):
    """A call without the capability it needs: refused, nothing done."""


class RefusalLog:
    def __init__(
        self,
        who: str,
        *,
        interval_s: float = REFUSAL_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.who = who
        self.interval_s = interval_s
        self.clock = clock
        self.logger = logger
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # kind -> when last logged
        self._quiet: dict[str, int] = {}  # kind -> refusals not logged since

    def refuse(self, method: str, claimed: object = None) -> Refused:
        """Note one refusal of `method` (claiming to act on `claimed`) and return the error
        to raise."""
        why = f"{self.who}: {method} refused: no valid capability"
        if claimed is not None:
            why += f" for {claimed!r}"[:200]
        now = self.clock()
        with self._lock:
            last = self._last.get(method)
            if last is not None and now - last < self.interval_s:
                self._quiet[method] = self._quiet.get(method, 0) + 1
                return Refused(why)
            self._last[method] = now
            quiet = self._quiet.pop(method, 0)
        more = f" ({quiet} more refused since the last line)" if quiet else ""
        self.logger.warning("%s%s", why, more)
        return Refused(why)
