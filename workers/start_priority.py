"""A starting worker process imports ahead of the training ranks beside it.

A warm process's start is almost all CPU: Ray's worker, then torch, `torch._dynamo` and the
loop imported (~3.5 s of one core on the 2-core bench machine). Started where ranks train
(in the bench every Ray node shares the machine's 2 cores; on a real node, ranks of other
jobs or its own spare), it gets a fair share with them (Ray runs every worker at nice 15),
and its start took 6-15 s in `bench/elastic_bench.py` (docs/bench-elastic.md), a grow onto
its node waiting all that time. So its imports run at a raised priority (a lower nice value) where the process may
raise it (root, CAP_SYS_NICE or RLIMIT_NICE), and every thread goes back to the process's
own priority when they are done (the threads started meanwhile too): a few seconds of
the ranks' CPU, once per process.

Linux's nice value belongs to a thread; `os.setpriority(PRIO_PROCESS, 0, ...)` sets the
calling thread's. Threads started during the imports inherit it, hence the look at
`/proc/self/task` before and after.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

#: How far below the process's nice value its imports run (nice -10 against 0 weighs
#: ~9x in Linux's scheduler: the importer gets near a core of its own).
IMPORT_BOOST = 10


def boosted_nice(base: int, boost: int = IMPORT_BOOST) -> int:
    """The nice value to import at: `boost` below `base`, within Linux's -20..19."""
    return max(-20, min(19, base - boost))


@contextlib.contextmanager
def imports_first(boost: int = IMPORT_BOOST) -> Iterator[bool]:
    """Run the body at `boost` below this thread's nice value when allowed (yields whether
    it was); then every thread of the process runs at the value it had before."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    before = set(_threads())
    try:
        os.setpriority(os.PRIO_PROCESS, 0, boosted_nice(base, boost))
        raised = True
    except OSError:  # not allowed to raise its priority: imports at its share
        raised = False
    try:
        yield raised
    finally:
        if raised:
            os.setpriority(os.PRIO_PROCESS, 0, base)
            _restore(set(_threads()) - before, base)


def _restore(threads: set[int], base: int) -> None:
    """Threads started during the imports (they inherited the raised priority) back to
    `base`; the process's other threads were never changed."""
    for tid in threads:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if os.getpriority(os.PRIO_PROCESS, tid) < base:
                os.setpriority(os.PRIO_PROCESS, tid, base)


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread alone is restored
        return []
