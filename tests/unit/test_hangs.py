"""The hang watch's decision (`elastrain.workers.runtime.hangs.find_hang`), table-tested:
which ranks of an attempt are hung, from their processes' answers, at wall time NOW."""

from __future__ import annotations

import pytest

from elastrain.contracts.group import RankProgress
from elastrain.workers.runtime.hangs import DEFAULT_FLOOR_S, RankSeen, find_hang, threshold_s

NOW = 10_000.0


def rank(
    *, ago: float = 0.5, phase: str = "step", steps: int = 5, median: float | None = 0.1,
    silent: float | None = None, since: float | None = None,
) -> RankSeen:  # fmt: skip
    """A rank that finished its last step `ago` seconds before NOW, doing `phase` for
    `since` seconds (default: since then), whose poll has been out `silent` seconds (None:
    answered)."""
    progress = RankProgress(
        step=steps, last_step_at=NOW - ago, steps_done=steps, phase=phase,
        phase_since=NOW - (ago if since is None else since), median_step_s=median,
        where="stall.py:30 in __getitem__",
    )  # fmt: skip
    return RankSeen(progress, unanswered_since=None if silent is None else NOW - silent)


@pytest.mark.parametrize(
    ("seen", "after", "hung", "words"),
    [
        # training: nothing
        ({0: rank(), 1: rank()}, None, None, ""),
        # before the first step: no step is late, however long (a compile, a warm-up)
        ({0: rank(ago=600, steps=0, median=None), 1: rank(ago=600, steps=0, median=None)},
         None, None, ""),
        # ... but a frozen process is, once silent START_SILENT_S: its peers wait for it in
        # the rendezvous (their polls answer: no loop yet) and must not be the ones blamed
        ({0: RankSeen(None), 1: RankSeen(None, unanswered_since=NOW - 31)}, None, (1,),
         "rank 1: its process has not answered for 31s, before the attempt's first step"),
        ({0: RankSeen(None), 1: RankSeen(None, unanswered_since=NOW - 29)}, None, None, ""),
        ({0: rank(ago=600, steps=0, median=None), 1: rank(steps=0, median=None, silent=31)},
         None, (1,), "rank 1: its process has not answered for 31s"),
        # ... or the job's own threshold
        ({0: RankSeen(None), 1: RankSeen(None, unanswered_since=NOW - 13)}, 12.0, (1,),
         "rank 1: its process has not answered for 13s"),
        # a stuck data loader: the rank still getting its batch, the others in the step
        ({0: rank(ago=12), 1: rank(ago=12, phase="data"), 2: rank(ago=12)}, None, (1,),
         "rank 1: no step finished for 12s after step 5, in data for 12s at stall.py:30"),
        # not yet past the threshold: max(10 s, 5 x the median step)
        ({0: rank(ago=9), 1: rank(ago=9, phase="data")}, None, None, ""),
        ({0: rank(ago=12, median=3.0), 1: rank(ago=12, median=3.0, phase="data")},
         None, None, ""),
        ({0: rank(ago=16, median=3.0), 1: rank(ago=16, median=3.0, phase="data")},
         None, (1,), "rank 1:"),
        # the job's own threshold
        ({0: rank(ago=4), 1: rank(ago=4, phase="data")}, 3.0, (1,), "rank 1:"),
        # all in the step (a collective that never returns): all are named
        ({0: rank(ago=12), 1: rank(ago=12)}, None, (0, 1), "rank 0:"),
        # a frozen process: its poll out past the threshold, while the others answer
        ({0: rank(ago=0.2), 1: rank(ago=0.2, silent=11)}, None, (1,),
         "rank 1: its process has not answered for 11s"),
        # stalled, and one process quiet for a second: that one, before any phase rule
        ({0: rank(ago=4), 1: rank(ago=4, silent=1.5)}, 3.0, (1,),
         "rank 1: no step finished for 4s and its process has not answered for 2s"),
        # a poll out for a moment while steps go on: nothing
        ({0: rank(), 1: rank(silent=1.5)}, 3.0, None, ""),
        # a long checkpoint or evaluation is no hang; a silent process still is
        ({0: rank(ago=60, phase="checkpoint"), 1: rank(ago=60, phase="checkpoint")}, None,
         None, ""),
        ({0: rank(ago=60, phase="eval"), 1: rank(ago=60, phase="step")}, None, None, ""),
        ({0: rank(ago=60, phase="checkpoint"), 1: rank(ago=60, silent=12)}, None, (1,),
         "rank 1: its process has not answered"),
        # the first step after a long checkpoint: the clock starts at the phase's start
        ({0: rank(ago=60, phase="step", since=2), 1: rank(ago=60, phase="data", since=2)},
         None, None, ""),
        ({0: rank(ago=60, phase="step", since=11), 1: rank(ago=60, phase="data", since=12)},
         None, (1,), "rank 1: no step finished for 60s after step 5, in data for 12s"),
    ],
)  # fmt: skip
def test_find_hang(
    seen: dict[int, RankSeen], after: float | None, hung: tuple[int, ...] | None, words: str
) -> None:
    found = find_hang(seen, NOW, after)
    assert (found.ranks if found else None) == hung
    if found is not None:
        assert words in found.why, found.why


def test_the_default_threshold_scales_with_the_step() -> None:
    assert threshold_s({0: rank(median=0.1)}, None) == DEFAULT_FLOOR_S
    assert threshold_s({0: rank(median=4.0), 1: rank(median=6.0)}, None) == 25.0
    assert threshold_s({0: rank(steps=1, median=None)}, None) == DEFAULT_FLOOR_S
    assert threshold_s({0: rank(steps=0, median=None)}, None) is None
    assert threshold_s({0: rank(median=4.0)}, 2.0) == 2.0
