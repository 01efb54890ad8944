"""The hang watch: which ranks of a running attempt are hung, from what their processes
answer the runtime's poll (`elastrain.workers.progress`). Pure: table-tested in
tests/unit/test_hangs.py; the driver polls and acts (`elastrain.workers.runtime.driver`).

A rank is hung when it made no progress for the job's threshold (`failure.hang_after_s`,
by default max(10 s, 5x the median step time)):

- its process has not answered a poll for that long (frozen: SIGSTOP, a hung kernel, a
  process wedged below Python); or
- no rank finished a step for that long. Ranks train in lockstep, so all stop at once,
  and the one that stopped them is the one whose process does not answer (a process
  answers from another thread while its rank waits in a collective), else the one not
  doing what the others do: the others wait
  in the step's collectives (`step`) while it is still getting its batch (`data`: a stuck
  data loader), or the reverse. When all do the same, no rank can be told from the rest
  (a collective that never returns, or user code stuck inside the step): all are named.

Before the attempt's first step (a first step may compile, or warm up, for minutes) only a
silent process is a hang, and only once silent for `START_SILENT_S` (or the job's own
threshold): a process answers its polls from another thread while its rank compiles or
waits for its peers, but a frozen one never starts its rank, and the others would wait
for it in the group's rendezvous until their timeout and be blamed for it (a chaos run
placed such a process into eleven attempts in a row). Not watched for ranks whose process
reports no loop (`workload.command` scripts); while a rank checkpoints or evaluates
(which may take long), only a silent process is a hang.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

from elastrain.contracts.group import RankProgress

#: The shortest threshold the default allows, and how many median steps it is.
DEFAULT_FLOOR_S = 10.0
MEDIAN_STEPS = 5.0
#: A poll unanswered this long, while no rank steps, marks its rank as the cause.
QUIET_S = 1.0
#: Before the first step, how long a process may leave a poll unanswered: well under the
#: group rendezvous' timeout (`collective_timeout_s`, 60 s by default), so the silent rank
#: is named before its peers give up waiting for it.
START_SILENT_S = 30.0
#: The phases a rank is expected to leave within the threshold; in any other (a
#: checkpoint, an evaluation, the start) only a silent process is a hang.
WATCHED_PHASES = frozenset({"data", "step"})


@dataclass(frozen=True, slots=True)
class RankSeen:
    progress: RankProgress | None
    """Its last answer (None: none yet, or no loop runs there)."""
    unanswered_since: float | None = None
    """When the oldest poll it has not answered was sent (wall clock); None: all answered."""


@dataclass(frozen=True, slots=True)
class Hang:
    ranks: tuple[int, ...]
    threshold_s: float
    why: str
    """One line per rank named, for the attempt's error."""


def threshold_s(seen: dict[int, RankSeen], hang_after_s: float | None) -> float | None:
    """The job's threshold, or None while it cannot be known (no rank finished a step)."""
    if hang_after_s is not None:
        return hang_after_s
    medians = [
        s.progress.median_step_s
        for s in seen.values()
        if s.progress is not None and s.progress.median_step_s is not None
    ]
    if not medians:
        return DEFAULT_FLOOR_S if any(_stepped(s) for s in seen.values()) else None
    return max(DEFAULT_FLOOR_S, MEDIAN_STEPS * statistics.median(medians))


def find_hang(seen: dict[int, RankSeen], now: float, hang_after_s: float | None) -> Hang | None:
    """The hung ranks of an attempt at wall time `now`, or None."""
    if not any(_stepped(s) for s in seen.values()):
        return _silent_before_first_step(seen, now, hang_after_s)
    limit = threshold_s(seen, hang_after_s)
    assert limit is not None
    silent = _unanswered(seen, now, limit)
    if silent:
        return _hang(
            limit, {r: f"its process has not answered for {s:.0f}s" for r, s in silent.items()}
        )
    answered = {r: s.progress for r, s in seen.items() if s.progress is not None}
    if not answered or any(p.phase not in WATCHED_PHASES for p in answered.values()):
        return None  # a checkpoint or an evaluation may take long: only silence counts then
    # The last sign of progress: a step finished, or a rank moving on to its next phase.
    last = max(max(p.last_step_at, p.phase_since) for p in answered.values())
    if now - last < limit:
        return None
    # Stalled. A process answers within milliseconds even while its rank waits in a
    # collective (another thread answers): one that does not is the cause.
    quiet = _unanswered(seen, now, QUIET_S)
    if quiet:
        stalled = f"no step finished for {now - last:.0f}s"
        return _hang(
            limit,
            {
                r: f"{stalled} and its process has not answered for {s:.0f}s"
                for r, s in quiet.items()
            },
        )
    phases = Counter(p.phase for p in answered.values())
    usual = phases.most_common(1)[0][0]
    odd = sorted(r for r, p in answered.items() if p.phase != usual)
    named = odd if odd and len(odd) < len(answered) else sorted(answered)
    return _hang(limit, {r: _describe(answered[r], now) for r in named})


def _silent_before_first_step(
    seen: dict[int, RankSeen], now: float, hang_after_s: float | None
) -> Hang | None:
    limit = hang_after_s if hang_after_s is not None else START_SILENT_S
    silent = _unanswered(seen, now, limit)
    if not silent:
        return None
    return _hang(
        limit,
        {
            r: f"its process has not answered for {s:.0f}s, before the attempt's first step"
            for r, s in silent.items()
        },
    )


def _unanswered(seen: dict[int, RankSeen], now: float, at_least: float) -> dict[int, float]:
    """Ranks whose poll has been out at least `at_least` seconds, and for how long."""
    return {
        rank: now - s.unanswered_since
        for rank, s in seen.items()
        if s.unanswered_since is not None and now - s.unanswered_since >= at_least
    }


def _hang(threshold: float, why: dict[int, str]) -> Hang:
    ranks = tuple(sorted(why))
    return Hang(
        ranks=ranks, threshold_s=threshold, why="; ".join(f"rank {r}: {why[r]}" for r in ranks)
    )


def _stepped(s: RankSeen) -> bool:
    return s.progress is not None and s.progress.steps_done > 0


def _describe(p: RankProgress, now: float) -> str:
    where = f" at {p.where}" if p.where else ""
    return (
        f"no step finished for {now - p.last_step_at:.0f}s after step {p.step}, "
        f"in {p.phase} for {now - p.phase_since:.0f}s{where}"
    )
