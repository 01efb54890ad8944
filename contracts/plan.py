"""The memory plan: bytes per rank for each strategy at a world size, and the choice.

The decision framework of the texts this project learned from: if the model, its gradients
and its optimizer state fit on one device, use DDP (fastest: one all-reduce a step); if
they do not, shard them (FSDP, ZeRO-3), or split the model's depth (pipeline); if even one
layer's working set does not fit, split the layers (tensor parallel, T ranks per layer,
alone or under FSDP). `plan()` prices each against the memory one worker has and picks the
first that fits, in that order, and says why.

What a rank holds (fp32 master weights, AdamW: two states per parameter):

| strategy | parameters | gradients | optimizer | extra |
| --- | --- | --- | --- | --- |
| ddp | 4N | 4N | 8N | 4N: DDP's gradient buckets |
| fsdp | 4N/W + 8U | 4N/W + 4U | 8N/W | (U: one unit gathered, one prefetched) |
| pipeline (S stages) | 4Ns | 4Ns | 8Ns | 4Ns: the dp gradient sync's buckets |
| tp (T ranks a layer) | 4Nt | 4Nt | 8Nt | 4Nt: the dp gradient sync's buckets |
| fsdp + tp | 4Nt/dp + 8Ut | 4Nt/dp + 4Ut | 8Nt/dp | |
| fsdp, cpu_offload | 8U | 4U | 0 | (16N/W in host memory) |

(Nt, Ut: a tensor-parallel rank's share, (N - R)/T + R with R the parameters the plan keeps
whole, the layer norms and row-parallel biases; pipeline + tp splits a stage the same way.)

plus activations: what one micro-batch's forward keeps for backward (per sample, times the
micro-batch; a pipeline stage keeps its share of the layers for each micro-batch in flight:
all of them under GPipe, up to S under 1F1B; tensor parallelism divides the part computed
per head or per hidden unit by T, not the residual stream, the norms or the logits). Activation bytes per sample come from the
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

from elastrain.contracts.spec import (
    ActivationCheckpointing,
    JobSpec,
    MixedPrecision,
    StrategyKind,
    strategy_label,
)
from elastrain.contracts.workload_params import GptParams, SyntheticParams

#: The share of a device's memory a plan may use.
HEADROOM = 0.9
#: Vocabulary assumed for a text `data_path` (its characters are unknown until read).
TEXT_VOCAB_BOUND = 256
BUNDLED_VOCAB = 65
ORDER = (StrategyKind.ddp, StrategyKind.fsdp, StrategyKind.pipeline)
#: Tensor-parallel degrees a plan considers: within one node's devices.
TP_DEGREES = (2, 4, 8)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    params: int
    unit_params: int
    """The largest shard unit (a transformer block): what FSDP gathers at once."""
    units: int
    activations: dict[ActivationCheckpointing, float]
    """Bytes one sample's forward keeps for backward (fp32), whole model."""
    tp_split_activations: dict[ActivationCheckpointing, float] | None = None
    """The part of `activations` tensor parallelism splits; None: no tensor-parallel plan."""
    tp_whole_params: int = 0
    """Parameters tensor parallelism keeps whole on every rank (norms, row biases)."""
    tp_unit_whole_params: int = 0
    n_head: int = 1
    """Tensor-parallel degrees must divide it (each rank runs whole heads)."""

    def tp_share(self, n: int, whole: int, degree: int) -> int:
        """A tensor-parallel rank's share of `n` parameters of which `whole` are kept whole."""
        return math.ceil((n - whole) / degree) + whole

    def tp_degrees(self, world_size: int) -> list[int]:
        """The degrees worth pricing at `world_size`."""
        if self.tp_split_activations is None:
            return []
        return [t for t in TP_DEGREES if world_size % t == 0 and self.n_head % t == 0]

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
    # Per head / per hidden unit, hence split by tensor parallelism: q, k, v, the attention
    # output, the MLP's two hidden activations (13 of the 17 values); a checkpointed block
    # keeps only its (whole) input.
    split = {
        ActivationCheckpointing.none: 4.0 * t * layers * 13 * d,
        ActivationCheckpointing.full: 0.0,
        ActivationCheckpointing.selective: 4.0 * t * half * 13 * d,
    }
    unit_whole = 4 * d + 2 * d  # two layer norms, two row-parallel biases
    return ModelShape(params=params, unit_params=block, units=layers, activations=acts,
                      tp_split_activations=split, tp_whole_params=layers * unit_whole + 2 * d,
                      tp_unit_whole_params=unit_whole, n_head=p.n_head)  # fmt: skip


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
    tensor_parallel: int = 1
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

    @property
    def label(self) -> str:
        return strategy_label(self.strategy, self.tensor_parallel)


@dataclass(frozen=True, kw_only=True)
class Plan:
    world_size: int
    device_bytes: int
    usable_bytes: int
    rows: tuple[RankMemory, ...]
    chosen: RankMemory | None
    why: str

    @property
    def choice(self) -> StrategyKind | None:
        return self.chosen.strategy if self.chosen is not None else None


def price(
    shape: ModelShape,
    spec: JobSpec,
    kind: StrategyKind,
    world_size: int,
    usable: int,
    tensor_parallel: int = 1,
) -> RankMemory:
    """What one rank of `kind` (split `tensor_parallel` ways) at `world_size` holds, and
    whether it fits in `usable`."""
    tp = tensor_parallel
    n = shape.tp_share(shape.params, shape.tp_whole_params, tp)
    u = shape.tp_share(shape.unit_params, shape.tp_unit_whole_params, tp)
    act_dtype = (
        0.5 if spec.strategy.mixed_precision in (MixedPrecision.bf16, MixedPrecision.fp16) else 1.0
    )
    mode = spec.training.activation_checkpointing
    per_sample = shape.activations[mode]
    if tp > 1 and shape.tp_split_activations is not None:
        split = shape.tp_split_activations[mode]
        per_sample = per_sample - split + split / tp
    per_sample *= act_dtype
    micro = spec.training.micro_batch_size
    note = ""
    label = strategy_label(kind, tp)

    def cannot(why: str) -> RankMemory:
        return RankMemory(strategy=kind, world_size=world_size, tensor_parallel=tp, params=0,
                          grads=0, optimizer=0, extra=0, activations=0, fits=False,
                          note=why)  # fmt: skip

    if world_size % tp:
        return cannot(f"{label} cannot run at world size {world_size}")
    if kind is StrategyKind.ddp or kind is StrategyKind.tp:
        # ddp: the whole model; tp: one tensor-parallel share, replicas averaged like DDP.
        params, grads, optim, extra = 4 * n, 4 * n, 8 * n, 4 * n
        acts = per_sample * micro
    elif kind is StrategyKind.fsdp and spec.strategy.cpu_offload:
        # The shards live in host memory; the device holds the units being computed.
        dp = world_size // tp
        params, grads, optim, extra = 8 * u, 4 * u, 0, 0
        acts = per_sample * micro
        note = f"offloaded to host memory: {_gib(math.ceil(16 * n / dp))}"
    elif kind is StrategyKind.fsdp:
        dp = world_size // tp
        gathered = u if dp > 1 else 0  # one replica alone gathers nothing
        params, grads, optim, extra = (
            math.ceil(4 * n / dp) + 8 * gathered,
            math.ceil(4 * n / dp) + 4 * gathered,
            math.ceil(8 * n / dp),
            0,
        )
        acts = per_sample * micro
    else:
        stages = spec.strategy.stages
        if world_size % (stages * tp) or stages > shape.units:
            return cannot(f"{stages} stages > {shape.units} blocks" if stages > shape.units
                          else f"{label} of {stages} stages cannot run at world size "
                          f"{world_size}")  # fmt: skip
        blocks = math.ceil(shape.units / stages)
        # The worst stage carries an end's extras.
        stage = blocks * u + shape.tp_share(
            shape.outside_params,
            shape.tp_whole_params - shape.units * shape.tp_unit_whole_params,
            tp,
        )
        params, grads, optim, extra = 4 * stage, 4 * stage, 8 * stage, 4 * stage
        # A schedule step runs `microbatches` chunks of about one micro-batch each; GPipe
        # keeps all their activations until the backwards, 1F1B at most one per stage.
        in_flight = spec.strategy.n_microbatches
        if spec.strategy.pipeline_schedule.value == "1f1b":
            in_flight = min(in_flight, stages)
        acts = per_sample * (blocks / shape.units) * micro * in_flight
        note = f"{in_flight} micro-batches in flight"
    row = RankMemory(strategy=kind, world_size=world_size, tensor_parallel=tp, params=int(params),
                     grads=int(grads), optimizer=int(optim), extra=int(extra),
                     activations=int(acts), fits=False, note=note)  # fmt: skip
    return replace(row, fits=row.total <= usable)


def candidates(shape: ModelShape, world_size: int) -> list[tuple[StrategyKind, int]]:
    """(strategy, tensor-parallel degree) in the order a plan tries them: the
    framework's order, then each tensor-parallel degree alone, under FSDP (2-D) and in
    pipeline stages (3-D)."""
    out = [(kind, 1) for kind in ORDER]
    for degree in shape.tp_degrees(world_size):
        out += [
            (kind, degree) for kind in (StrategyKind.tp, StrategyKind.fsdp, StrategyKind.pipeline)
        ]
    return out


def plan(
    shape: ModelShape,
    spec: JobSpec,
    world_size: int,
    device_bytes: int,
    eligible: frozenset[StrategyKind] | None = None,
) -> Plan:
    """Every candidate priced at `world_size`, and the first (of `eligible` kinds) that
    fits."""
    usable = int(device_bytes * HEADROOM)
    rows = tuple(
        price(shape, spec, kind, world_size, usable, tp)
        for kind, tp in candidates(shape, world_size)
    )
    allowed = [r for r in rows if eligible is None or r.strategy in eligible]
    chosen = next((r for r in allowed if r.fits), None)
    if chosen is None:
        smallest = min((r for r in allowed if r.total), key=lambda r: r.total)
        why = (
            f"nothing fits {_gib(usable)} per worker at world size {world_size}: the smallest "
            f"is {smallest.label} at {_gib(smallest.total)}"
        )
        if 12 * shape.unit_params > usable and not shape.tp_degrees(world_size):
            why += (
                f"; one block's parameters, gradients and their gathers alone need "
                f"{_gib(12 * shape.unit_params)}, and tensor parallelism cannot split it "
                f"at world size {world_size}"
            )
        return Plan(world_size=world_size, device_bytes=device_bytes, usable_bytes=usable,
                    rows=rows, chosen=None, why=why)  # fmt: skip
    skipped = [r for r in allowed[: allowed.index(chosen)] if r.total]
    # Why not the simpler choices (ddp, fsdp), and the nearest miss.
    named = [r for r in skipped if r.tensor_parallel == 1 and r.strategy in AUTO_CHOICES]
    if skipped and (nearest := min(skipped, key=lambda r: r.total)) not in named:
        named.append(nearest)
    reasons = [f"{r.label} needs {_gib(r.total)}" for r in named]
    why = f"{chosen.label}: {_gib(chosen.total)} of {_gib(usable)} per worker"
    if reasons:
        why += f" ({'; '.join(reasons)}, more than fits)"
    return Plan(world_size=world_size, device_bytes=device_bytes, usable_bytes=usable, rows=rows,
                chosen=chosen, why=why)  # fmt: skip


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


#: What `strategy.kind: auto` chooses among: one replica's layers on every rank, or a
#: tensor-parallel split of them, so any world size works (a pipeline needs a stage count
#: chosen with the model in mind).
AUTO_CHOICES = frozenset({StrategyKind.ddp, StrategyKind.fsdp, StrategyKind.tp})


@dataclass(frozen=True, kw_only=True)
class AutoChoice:
    strategy: StrategyKind
    why: str
    plan: Plan | None
    tensor_parallel: int = 1

    @property
    def label(self) -> str:
        return strategy_label(self.strategy, self.tensor_parallel)


def choose_for_auto(spec: JobSpec, world_size: int, device_bytes: int | None) -> AutoChoice:
    """What an `auto` job runs at `world_size`: the first of DDP, FSDP, then tensor
    parallel (alone, then under FSDP, by growing degree) that fits a worker's memory;
    when nothing fits, what needs the least; FSDP when the memory is unknown."""
    shape = shape_of(spec)
    if shape is None or device_bytes is None:
        why = "fsdp: no memory figure for the workers (set ELASTRAIN_WORKER_MEMORY_BYTES)"
        return AutoChoice(strategy=StrategyKind.fsdp, why=why, plan=None)
    made = plan(shape, spec, world_size, device_bytes, eligible=AUTO_CHOICES)
    row = made.chosen
    why = made.why
    if row is None:
        row = min((r for r in made.rows if r.strategy in AUTO_CHOICES and r.total),
                  key=lambda r: r.total)  # fmt: skip
        why = f"{row.label}, the least memory; {made.why}"
    return AutoChoice(
        strategy=row.strategy, tensor_parallel=row.tensor_parallel, why=why, plan=made
    )
