"""The memory plan: bytes per rank for each strategy at a world size, and the choice.

The decision framework of the texts this project learned from: if the model, its gradients
and its optimizer state fit on one device, use DDP (fastest: one all-reduce a step); if
they do not, shard them (FSDP, ZeRO-3); if even one layer's working set does not fit, split
the model's depth (pipeline). `plan()` prices each against the memory one worker has and
picks the first that fits, in that order, and says why.

What a rank holds (fp32 master weights, AdamW: two states per parameter):

| strategy | parameters | gradients | optimizer | extra |
| --- | --- | --- | --- | --- |
| ddp | 4N | 4N | 8N | 4N: DDP's gradient buckets |
| fsdp | 4N/W + 8U | 4N/W + 4U | 8N/W | (U: one unit gathered, one prefetched) |
| pipeline (S stages) | 4Ns | 4Ns | 8Ns | 4Ns: the dp gradient sync's buckets |

plus activations: what one micro-batch's forward keeps for backward (per sample, times the
micro-batch; a pipeline stage keeps its share of the layers for each micro-batch in flight:
all of them under GPipe, up to S under 1F1B). Activation bytes per sample come from the
workload's shapes (the gpt: 17·d values per token per block kept by autograd, the block's
input only under full checkpointing, plus logits; measured against the real meter in
tests/unit/test_plan.py). The estimate ignores allocator fragmentation and the CUDA context:
`HEADROOM` of the device is kept free.

Torch-free and pure: the API (`POST /v1/plan`), the CLI (`elastrain plan`) and the
scheduler (`strategy.kind: auto`) share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from contracts.spec import ActivationCheckpointing, JobSpec, MixedPrecision, StrategyKind
from contracts.workload_params import GptParams, SyntheticParams

#: The share of a device's memory a plan may use.
HEADROOM = 0.9
#: Vocabulary assumed for a text `data_path` (its characters are unknown until read).
TEXT_VOCAB_BOUND = 256
BUNDLED_VOCAB = 65
ORDER = (StrategyKind.ddp, StrategyKind.fsdp, StrategyKind.pipeline)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    params: int
    unit_params: int
    """The largest shard unit (a transformer block): what FSDP gathers at once."""
    units: int
    activations: dict[ActivationCheckpointing, float]
    """Bytes one sample's forward keeps for backward (fp32), whole model."""

    @property
    def outside_params(self) -> int:
        """Parameters outside the units (embeddings, head)."""
        return self.params - self.units * self.unit_params


def gpt_shape(p: GptParams) -> ModelShape:
    d, t, layers = p.n_embd, p.seq_len, p.n_layer
    if p.data_path is None:
        vocab = BUNDLED_VOCAB
    else:
        vocab = p.vocab_size if p.vocab_size is not None else TEXT_VOCAB_BOUND
    block = 12 * d * d + 13 * d
    params = vocab * d + t * d + layers * block + 2 * d + d * vocab
    per_block = {  # values kept per token per block
        ActivationCheckpointing.none: 17 * d,
        ActivationCheckpointing.full: d,
    }
    outside = t * (vocab + 2 * d)  # embeddings' output, the final norm, the log-softmax
    acts = {
        mode: 4.0 * (t * layers * per_block[mode] + outside)
        for mode in (ActivationCheckpointing.none, ActivationCheckpointing.full)
    }
    half = layers // 2  # selective: every second block (the first of each pair) recomputed
    recomputed = layers - half
    acts[ActivationCheckpointing.selective] = 4.0 * (
        t * (recomputed * per_block[ActivationCheckpointing.full]
             + half * per_block[ActivationCheckpointing.none]) + outside
    )  # fmt: skip
    return ModelShape(params=params, unit_params=block, units=layers, activations=acts)


def synthetic_shape(p: SyntheticParams) -> ModelShape:
    h = p.hidden
    block = h * h + h
    params = p.in_dim * h + h + p.n_layer * block + h * p.out_dim + p.out_dim
    none = 4.0 * (p.in_dim + h + p.n_layer * 2 * h + 2 * p.out_dim)
    full = 4.0 * (p.in_dim + h + p.n_layer * h + 2 * p.out_dim)
    selective = (none + full) / 2
    return ModelShape(
        params=params,
        unit_params=block,
        units=p.n_layer,
        activations={
            ActivationCheckpointing.none: none,
            ActivationCheckpointing.full: full,
            ActivationCheckpointing.selective: selective,
        },
    )


def shape_of(spec: JobSpec) -> ModelShape | None:
    """The built-in workloads' shapes; None for a custom entrypoint (unknown before it runs)."""
    if spec.workload.name == "gpt":
        return gpt_shape(GptParams.model_validate(spec.workload.params))
    if spec.workload.name == "synthetic":
        return synthetic_shape(SyntheticParams.model_validate(spec.workload.params))
    return None


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    strategy: StrategyKind
    world_size: int
    params: int
    grads: int
    optimizer: int
    extra: int
    activations: int
    fits: bool
    note: str = ""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.extra + self.activations


@dataclass(frozen=True, kw_only=True)
class Plan:
    world_size: int
    device_bytes: int
    usable_bytes: int
    rows: tuple[RankMemory, ...]
    choice: StrategyKind | None
    why: str


def price(
    shape: ModelShape, spec: JobSpec, kind: StrategyKind, world_size: int, usable: int
) -> RankMemory:
    """What one rank of `kind` at `world_size` holds, and whether it fits in `usable`."""
    n, u = shape.params, shape.unit_params
    act_dtype = (
        0.5 if spec.strategy.mixed_precision in (MixedPrecision.bf16, MixedPrecision.fp16) else 1.0
    )
    per_sample = shape.activations[spec.training.activation_checkpointing] * act_dtype
    micro = spec.training.micro_batch_size
    note = ""
    if kind is StrategyKind.ddp:
        params, grads, optim, extra = 4 * n, 4 * n, 8 * n, 4 * n
        acts = per_sample * micro
    elif kind is StrategyKind.fsdp:
        w = world_size
        params, grads, optim, extra = (
            math.ceil(4 * n / w) + 8 * u,
            math.ceil(4 * n / w) + 4 * u,
            math.ceil(8 * n / w),
            0,
        )
        acts = per_sample * micro
    else:
        stages = spec.strategy.stages
        if world_size % stages or stages > shape.units:
            return RankMemory(strategy=kind, world_size=world_size, params=0, grads=0, optimizer=0,
                              extra=0, activations=0, fits=False,
                              note=f"{stages} stages cannot run at world size {world_size}"
                              if world_size % stages else f"{stages} stages > {shape.units} blocks")  # fmt: skip
        blocks = math.ceil(shape.units / stages)
        stage = blocks * u + shape.outside_params  # the worst stage carries an end's extras
        params, grads, optim, extra = 4 * stage, 4 * stage, 8 * stage, 4 * stage
        # A schedule step runs `microbatches` chunks of about one micro-batch each; GPipe
        # keeps all their activations until the backwards, 1F1B at most one per stage.
        in_flight = spec.strategy.n_microbatches
        if spec.strategy.pipeline_schedule.value == "1f1b":
            in_flight = min(in_flight, stages)
        acts = per_sample * (blocks / shape.units) * micro * in_flight
        note = f"{in_flight} micro-batches in flight"
    row = RankMemory(strategy=kind, world_size=world_size, params=int(params), grads=int(grads),
                     optimizer=int(optim), extra=int(extra), activations=int(acts), fits=False,
                     note=note)  # fmt: skip
    return replace(row, fits=row.total <= usable)


def plan(shape: ModelShape, spec: JobSpec, world_size: int, device_bytes: int) -> Plan:
    """Every strategy priced at `world_size`, and the first in ORDER that fits."""
    usable = int(device_bytes * HEADROOM)
    rows = tuple(price(shape, spec, kind, world_size, usable) for kind in ORDER)
    choice = next((r for r in rows if r.fits), None)
    if choice is None:
        smallest = min((r for r in rows if r.total), key=lambda r: r.total)
        why = (
            f"nothing fits {_gib(usable)} per worker at world size {world_size}: the smallest "
            f"is {smallest.strategy.value} at {_gib(smallest.total)}"
        )
        if 12 * shape.unit_params > usable:
            why += (
                f"; one block's parameters, gradients and their gathers alone need "
                f"{_gib(12 * shape.unit_params)}: only tensor parallelism (not built yet) "
                "would split it"
            )
        return Plan(world_size=world_size, device_bytes=device_bytes, usable_bytes=usable,
                    rows=rows, choice=None, why=why)  # fmt: skip
    skipped = [r for r in rows[: rows.index(choice)]]
    reasons = [f"{r.strategy.value} needs {_gib(r.total)}" for r in skipped]
    why = f"{choice.strategy.value}: {_gib(choice.total)} of {_gib(usable)} per worker"
    if reasons:
        why += f" ({'; '.join(reasons)}, more than fits)"
    return Plan(world_size=world_size, device_bytes=device_bytes, usable_bytes=usable, rows=rows,
                choice=choice.strategy, why=why)  # fmt: skip


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


#: What `strategy.kind: auto` chooses among: one replica's layers on every rank, so any
#: world size works (a pipeline needs a stage count chosen with the model in mind).
AUTO_CHOICES = (StrategyKind.ddp, StrategyKind.fsdp)


@dataclass(frozen=True, kw_only=True)
class AutoChoice:
    strategy: StrategyKind
    why: str
    plan: Plan | None


def choose_for_auto(spec: JobSpec, world_size: int, device_bytes: int | None) -> AutoChoice:
    """The strategy an `auto` job runs at `world_size`: DDP when it fits a worker's memory,
    else FSDP (also when nothing fits, FSDP needing the least, or when the memory is unknown)."""
    shape = shape_of(spec)
    if shape is None or device_bytes is None:
        why = "fsdp: no memory figure for the workers (set ELASTRAIN_WORKER_MEMORY_BYTES)"
        return AutoChoice(strategy=StrategyKind.fsdp, why=why, plan=None)
    made = plan(shape, spec, world_size, device_bytes)
    if made.choice in AUTO_CHOICES:
        return AutoChoice(strategy=made.choice, why=made.why, plan=made)
    return AutoChoice(
        strategy=StrategyKind.fsdp, why=f"fsdp, the least memory; {made.why}", plan=made
    )
