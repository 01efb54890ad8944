"""How many exports run at once: each holds a task on the cluster with two copies of a model's
weights (the checkpoint's and the Hugging Face model's), so concurrent exports are
bounded in all and per tenant, per API process (`Settings.export_max_concurrent`,
`Settings.export_max_per_tenant`). Past either, the request is a 429 at once: an export
that waits would hold its HTTP connection for nothing."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from elastrain.api.errors import TooMany


class ExportSlots:
    def __init__(self, *, total: int, per_tenant: int) -> None:
        self.total = total
        self.per_tenant = per_tenant
        self._lock = threading.Lock()
        self._running: Counter[str] = Counter()

    @contextmanager
    def slot(self, tenant: str) -> Iterator[None]:
        """Hold one export slot of `tenant` while inside; TooMany when none is free."""
        with self._lock:
            if self._running.total() >= self.total:
                raise TooMany(
                    f"{self.total} exports are running, the most at once "
                    "(ELASTRAIN_EXPORT_MAX_CONCURRENT); try again when one ends"
                )
            if self._running[tenant] >= self.per_tenant:
                raise TooMany(
                    f"your tenant runs {self._running[tenant]} exports, the most at once "
                    "(ELASTRAIN_EXPORT_MAX_PER_TENANT); try again when one ends"
                )
            self._running[tenant] += 1
        try:
            yield
        finally:
            with self._lock:
                self._running[tenant] -= 1
                if self._running[tenant] <= 0:
                    del self._running[tenant]
