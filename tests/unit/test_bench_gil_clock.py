"""The GIL proxy's split of the training thread's time (bench/checkpoint_gil.py): Linux's
per-thread schedstat gives time on a CPU and time runnable but waiting; the rest of the
wall time is sleep, counted apart inside the save's own blocking calls. Real threads,
real /proc."""

from __future__ import annotations

import threading
import time

import pytest

from bench.checkpoint_gil import TrainingClock, others_cpu


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_sleep_inside_and_outside_the_blocking_calls_are_told_apart() -> None:
    clock = TrainingClock()
    spin(0.05)
    time.sleep(0.1)  # outside: what the proxy counts as GIL wait
    clock.inside(time.sleep, 0.2)  # inside: blocked
    split = clock.stop()
    assert split["on_cpu"] == pytest.approx(0.05, abs=0.04)
    assert split["sleep"] == pytest.approx(0.1, abs=0.04)
    assert split["blocked_sleep"] == pytest.approx(0.2, abs=0.04)
    total = split["on_cpu"] + split["runqueue"] + split["sleep"] + split["blocked_sleep"]
    assert total == pytest.approx(split["wall"], abs=1e-3)


def test_a_thread_waiting_for_the_gil_sleeps() -> None:
    """A thread that wants the GIL while another holds it in Python is asleep, not on a
    run queue: the proxy's reading of sleep as GIL wait."""
    clock = TrainingClock()
    holder = threading.Thread(target=spin, args=(0.3,))
    holder.start()
    clock.inside(time.sleep, 0.01)
    while holder.is_alive():  # Python work that must keep winning the GIL back
        sum(range(100))
    clock.inside(holder.join)
    split = clock.stop()
    # The two threads take turns of the switch interval: ~half of the 0.3 s asleep.
    assert split["sleep"] > 0.05
    assert clock.tid not in others_cpu(clock.tid)
