"""Restore timings by source: read from the STATE_RESTORED mark's typed source."""

from __future__ import annotations

import pytest

from elastrain.contracts.messages import (
    DriverReport,
    DriverStatus,
    Phase,
    RestoreSource,
    Timeline,
    TimelineMark,
)
from elastrain.service.telemetry import RESTORES, report_samples


def _timeline(restored: TimelineMark) -> Timeline:
    return Timeline(
        cause="node lost",
        marks=(
            TimelineMark(phase=Phase.DETECTED, at=100.0),
            TimelineMark(phase=Phase.GROUP_FORMED, at=101.0),
            restored,
            TimelineMark(phase=Phase.FIRST_STEP, at=104.0),
        ),
    )


@pytest.mark.parametrize(
    ("mark", "expected"),
    [
        (
            TimelineMark(phase=Phase.STATE_RESTORED, at=102.5, detail="peer memory at step 7",
                         source=RestoreSource.PEER),
            [(("peer",), 1.5)],
        ),
        (
            # The detail is for people: a checkpoint restore that mentions a peer is still one.
            TimelineMark(phase=Phase.STATE_RESTORED, at=103.0, detail="checkpoint of peer run",
                         source=RestoreSource.CHECKPOINT),
            [(("checkpoint",), 2.0)],
        ),
        # A fresh start restored nothing: no restore to time.
        (TimelineMark(phase=Phase.STATE_RESTORED, at=101.2, detail="fresh start"), []),
    ],
)  # fmt: skip
def test_restore_seconds_by_source(
    mark: TimelineMark, expected: list[tuple[tuple[str, ...], float]]
) -> None:
    report = DriverReport(status=DriverStatus.RUNNING, messages=(_timeline(mark),))
    restores = [
        (s.labels, s.value) for s in report_samples(report, tenant="t") if s.metric is RESTORES
    ]
    assert restores == expected


def test_the_timeline_event_carries_the_source() -> None:
    mark = TimelineMark(phase=Phase.STATE_RESTORED, at=102.5, source=RestoreSource.PEER)
    phases = {p["phase"]: p for p in _timeline(mark).phases()}
    assert phases["state_restored"]["source"] == "peer"
    assert phases["group_formed"]["source"] is None
