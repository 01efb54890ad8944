"""CI's gate on the step's launch count and host waits (`bench/step_host_overhead.py
--gate`, in `make bench-quick`): what fails it, table-tested."""

from __future__ import annotations

import pytest

from bench.step_host_overhead import AGREEMENT_READS, GATE_RATIO, gate_failures


def row(service_ops: int, plain_ops: int, service_waits: int, plain_waits: int = 0) -> dict:  # type: ignore[type-arg]
    return {
        "label": "ddp fp32",
        "ops": {"service": service_ops, "plain": plain_ops},
        "waits": {"service": service_waits, "plain": plain_waits},
    }


@pytest.mark.parametrize(
    ("r", "failed"),
    [
        (row(2368, 2350, AGREEMENT_READS), ""),  # today's ddp: 0.992, the agreement's read
        (row(1000, 970, 0), ""),  # at the floor
        (row(1000, 960, 0), f"launch ops plain/service 0.960 < {GATE_RATIO}"),
        (row(1000, 1000, AGREEMENT_READS + 1), "2 host waits per step"),
        (row(1000, 1000, 2, plain_waits=1), ""),  # plain's own read allowed too
    ],
)
def test_gate(r: dict, failed: str) -> None:  # type: ignore[type-arg]
    found = gate_failures([r])
    assert (failed in found[0]) if failed else found == [], found
