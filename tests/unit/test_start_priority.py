"""A starting worker process's imports run ahead of the ranks beside it, then every thread
goes back to the process's priority (`elastrain.workers.start_priority`)."""

from __future__ import annotations

import os
import threading

import pytest

from elastrain.workers.start_priority import boosted_nice, imports_first


@pytest.mark.parametrize(
    ("base", "boost", "expected"),
    [
        pytest.param(15, 10, 5, id="ray-worker-niceness"),
        pytest.param(0, 10, -10, id="default-niceness"),
        pytest.param(-15, 10, -20, id="floor"),
        pytest.param(19, 0, 19, id="no-boost"),
    ],
)
def test_boosted_nice(base: int, boost: int, expected: int) -> None:
    assert boosted_nice(base, boost) == expected


def _nice(tid: int = 0) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_imports_first_restores_every_thread_started_meanwhile() -> None:
    # In a thread of its own, lowered first (always allowed), as Ray's workers run at 15.
    seen: dict[str, object] = {}

    def body() -> None:
        os.setpriority(os.PRIO_PROCESS, 0, 12)
        started: list[int] = []
        release = threading.Event()

        def child() -> None:
            started.append(threading.get_native_id())
            release.wait(5)

        with imports_first(boost=4) as raised:
            seen["raised"], seen["during"] = raised, _nice()
            helper = threading.Thread(target=child)
            helper.start()
            while not started:
                pass
            seen["child_during"] = _nice(started[0])
        seen["after"], seen["child_after"] = _nice(), _nice(started[0])
        release.set()
        helper.join()

    here = _nice()
    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    # Raised where allowed (root, CAP_SYS_NICE); never left raised; other threads untouched.
    expected_during = 8 if seen["raised"] else 12
    assert (seen["during"], seen["child_during"]) == (expected_during, expected_during)
    assert (seen["after"], seen["child_after"], _nice()) == (12, 12, here)
