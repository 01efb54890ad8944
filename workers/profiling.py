"""An opt-in profile of a few training steps, for finding where a step's time goes.

`ELASTRAIN_PROFILE_STEPS=FIRST:LAST` (in the workers' environment; a node setting the
service passes on) profiles optimizer steps FIRST..LAST of every attempt that runs
them, on every rank, with torch's profiler (CPU, and CUDA where there is a GPU), and
writes the operators' self times, by device and by host, to
`<job dir>/profile/attempt<A>-rank<R>.txt`. Off by default: the profiler itself slows
the steps it watches.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

PROFILE_STEPS = "ELASTRAIN_PROFILE_STEPS"
ROWS = 30


def steps_of(setting: str | None) -> tuple[int, int] | None:
    """FIRST:LAST (optimizer steps, 1-based as the metrics count them) or None when unset;
    a malformed setting is an error, not silently no profile."""
    if not setting:
        return None
    first, sep, last = setting.partition(":")
    try:
        span = (int(first), int(last) if sep else int(first))
    except ValueError:
        raise ValueError(f"{PROFILE_STEPS}={setting!r}: expected FIRST:LAST, e.g. 20:24") from None
    if not 1 <= span[0] <= span[1]:
        raise ValueError(f"{PROFILE_STEPS}={setting!r}: expected 1 <= FIRST <= LAST")
    return span


class StepProfiler:
    """Around the loop's steps: `before(step)` then `after(step)` with the step about to
    be / just done (1-based)."""

    def __init__(self, out: Path, span: tuple[int, int] | None) -> None:
        self.out = out
        self.span = span
        self._profile: profile | None = None

    @classmethod
    def from_env(cls, job_dir: Path, attempt: int, rank: int) -> StepProfiler:
        span = steps_of(os.environ.get(PROFILE_STEPS))
        return cls(job_dir / "profile" / f"attempt{attempt}-rank{rank}.txt", span)

    def before(self, step: int) -> None:
        if self.span is None or step != self.span[0] or self._profile is not None:
            return
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities)
        self._profile.__enter__()

    def after(self, step: int) -> None:
        if self._profile is None or self.span is None or step < self.span[1]:
            return
        prof, self._profile = self._profile, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        averages = prof.key_averages()
        tables = [f"steps {self.span[0]}..{self.span[1]}"]
        if torch.cuda.is_available():
            tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=ROWS))
        tables.append(averages.table(sort_by="self_cpu_time_total", row_limit=ROWS))
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text("\n\n".join(tables))
