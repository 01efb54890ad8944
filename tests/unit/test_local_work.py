"""The local work of a step (`workers/local_work.py`): its batch plus its optimizer update,
timed by the optimizer's own hooks, what the straggler watch compares across ranks."""

from __future__ import annotations

import time

import torch

from elastrain.workers.local_work import LocalWork
from elastrain.workers.progress import Progress


def test_a_step_s_local_work_is_its_batch_and_its_update() -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    slow = {"s": 0.0}

    def slowed(*_: object) -> None:
        time.sleep(slow["s"])  # an update that takes this long

    local = LocalWork(optimizer, torch.device("cpu"))
    optimizer.register_step_pre_hook(slowed)  # (after LocalWork's: inside what it times)
    assert local.take() is None  # no update yet: nothing to compare

    model(torch.ones(2, 4)).sum().backward()
    slow["s"] = 0.03
    local.data(0.01)
    optimizer.step()
    took = local.take()
    assert took is not None and 0.04 <= took < 0.2
    assert local.take() is None  # counted once

    local.close()  # the hooks are gone: a later update is not timed
    optimizer.step()
    assert local.take() is None


def test_progress_carries_the_recent_steps_local_work() -> None:
    progress = Progress()
    progress.started(10)
    for step, seconds in [(11, 0.01), (12, None), (13, 0.03)]:
        progress.stepped(step, seconds)
    assert progress.snapshot().local == ((11, 0.01), (13, 0.03))
    progress.started(13)  # a new attempt: its own window
    assert progress.snapshot().local == ()
