"""`POST /v1/plan`: a spec's memory plan (`elastrain.contracts.plan`) without submitting it: bytes per
rank for each strategy at each world size the job could run at, which fit, the choice and
why. `elastrain plan spec.yaml` prints it as a table."""

from __future__ import annotations

from fastapi import APIRouter

from elastrain.api.deps import CurrentPrincipal, SessionDep
from elastrain.api.errors import invalid
from elastrain.api.schemas import PlanOut, PlanRequest, RankMemoryOut, WorldSizePlan
from elastrain.contracts.plan import HEADROOM, plan, shape_of
from elastrain.service import cluster

router = APIRouter(prefix="/v1", tags=["plan"])


@router.post(
    "/plan",
    response_model=PlanOut,
    summary="Bytes per rank for each strategy and world size, and the strategy that fits",
    responses={422: {"description": "A custom workload, or no memory to plan against"}},
)
def make_plan(body: PlanRequest, _: CurrentPrincipal, session: SessionDep) -> PlanOut:
    spec = body.spec
    shape = shape_of(spec)
    if shape is None:
        raise invalid(
            ("body", "spec", "workload"),
            "spec.workload: plans are made for the built-in workloads; a custom model's size "
            "is unknown before it runs",
        )
    memory, source = body.device_memory_bytes, "device_memory_bytes"
    if memory is None and not spec.scaling.use_gpu:
        view = cluster.current(session)
        memory = cluster.worker_memory_bytes(view, spec.scaling.cpus_per_worker)
        source = f"the cluster's host memory, a {spec.scaling.cpus_per_worker:g}-CPU share"
    if memory is None:
        raise invalid(
            ("body", "device_memory_bytes"),
            "device_memory_bytes: required for GPU jobs, or when no scheduler has reported "
            "the nodes' memory",
        )
    sizes = [body.world_size] if body.world_size else spec.world_sizes or [spec.scaling.max_workers]
    plans = []
    for size in sizes:
        made = plan(shape, spec, size, memory)
        rows = [
            RankMemoryOut(strategy=r.label, params=r.params, grads=r.grads,
                          optimizer=r.optimizer, extra=r.extra, activations=r.activations,
                          total=r.total, fits=r.fits, note=r.note)
            for r in made.rows
        ]  # fmt: skip
        choice = made.chosen.label if made.chosen else None
        plans.append(WorldSizePlan(world_size=size, choice=choice, why=made.why, rows=rows))
    return PlanOut(device_memory_bytes=memory, usable_bytes=int(memory * HEADROOM), memory_source=source,
                   params=shape.params, plans=plans)  # fmt: skip
