"""The strategy's step dispatches no per-parameter work beyond what a plain torchrun loop
does (bench/step_host_overhead.py's two sides, on the same model and batches).

On a GPU the step is bound by the host's kernel launches (docs/bench-gpu.md), so an op
per parameter costs there what it hides on a CPU. The optimizer is counted as torch would
run it on a GPU (`as_on_a_gpu`: multi-tensor where the strategy leaves torch the choice),
since on a CPU torch runs it one parameter at a time whatever it was given: the strategy's
former `AdamW(fused=False)` (single-tensor on a GPU too) added ~9 ops per parameter here,
and its FSDP clipping's `to_local()` two more per parameter.

The extra ops the step may dispatch are a few per micro-batch (the summed loss, the
agreement, DDP's comm hook): a bound that holds at 2 and 12 layers alike and that one op
per parameter (30 parameters at 2 layers) breaks. And it reads no value back on the host
besides its agreement's one: one more read is one more wait for the GPU a step.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.dist_utils import run_distributed

MICRO_BATCHES = 4
PARAMS = '{"n_layer": 2, "n_embd": 16, "n_head": 2, "seq_len": 16}'
#: Measured: +24 (ddp) and +29 (fsdp) at 2, 4 and 12 layers with 4 micro-batches.
MAX_EXTRA_OPS = 12 * MICRO_BATCHES


def _count(rank: int, world: int, strategy: str) -> dict[str, Any]:
    import argparse

    from bench.step_host_overhead import op_counts, plain_step, service_step, spec_of
    from elastrain.workers.loop import Collator
    from elastrain.workers.workloads import load_workload

    args = argparse.Namespace(params=PARAMS, micro_batch=2, micro_batches=MICRO_BATCHES)
    spec = spec_of(args, strategy)
    service, strategy_obj = service_step(spec, bf16=False, gpu_optimizer=True)
    plain = plain_step(spec, bf16=False, gpu_optimizer=True)
    collate = Collator(load_workload(spec.workload).dataset)
    mbs = [collate([2 * i, 2 * i + 1]) for i in range(MICRO_BATCHES)]
    for _ in range(2):  # the optimizer's state exists from the first step on
        service(mbs)
        plain(mbs)
    counted = {"service": op_counts(service, mbs), "plain": op_counts(plain, mbs)}
    counts = {side: c[0] for side, c in counted.items()}  # the ops that launch work
    return {
        "totals": {side: sum(c.values()) for side, c in counts.items()},
        "waits": {side: dict(c[1]) for side, c in counted.items()},
        "params": sum(1 for _ in strategy_obj.model.parameters()),
        "diff": {
            op: counts["service"][op] - counts["plain"][op]
            for op in set(counts["service"]) | set(counts["plain"])
            if counts["service"][op] != counts["plain"][op]
        },
    }


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_step_dispatches_no_per_parameter_ops_beyond_the_plain_loop(strategy: str) -> None:
    (result,) = run_distributed(_count, 1, strategy)
    totals = result["totals"]
    assert result["params"] > MAX_EXTRA_OPS // 2  # one op per parameter would break the bound
    extra = totals["service"] - totals["plain"]
    assert extra <= MAX_EXTRA_OPS, (
        f"{strategy}: the step dispatches {extra} ops more than the plain loop "
        f"({totals}); differing ops: {result['diff']}"
    )
    # A value read back on the host (`.item()`, `.tolist()`, `bool(t)`) makes a GPU's host
    # wait for every kernel queued: the plain loop reads none, the step its agreement's
    # alone (AdamW's reads of its step counts, host tensors on a GPU too, are not counted).
    waits = result["waits"]
    assert waits["plain"] == {} and waits["service"] == {"tolist": 1}, (
        f"{strategy}: host reads per step {waits}"
    )
