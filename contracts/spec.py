"""The job spec: the public contract accepted by `POST /v1/jobs` and `elastrain submit`.

Every model forbids unknown fields and every check names the field it is about, so that
a 422 tells the user exactly what to change. The spec is plain data (no torch, no ray):
the API validates it, the DB stores it as JSON, and the driver and every worker receive it
as this model.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from elastrain.contracts.bounds import (
    MAX_PARAMS_BYTES,
    MAX_PARAMS_DEPTH,
    STORED,
    check_json_document,
    is_stored,
    no_control_characters,
)
from elastrain.contracts.packages import DIGEST_RE
from elastrain.contracts.workload_params import (
    BUILTIN_PARAMS,
    GptParams,
    HfCausalLmParams,
    params_problems,
)

#: Built-in workloads shipped with the package: name -> the factory's entrypoint in
#: `workers/workloads/`. Strings only, so the API validates without importing torch; the
#: workers resolve the entrypoint.
BUILTIN_WORKLOADS: dict[str, str] = {
    "gpt": "elastrain.workers.workloads.gpt:build",
    "hf_causal_lm": "elastrain.workers.workloads.hf_causal_lm:build",
    "synthetic": "elastrain.workers.workloads.synthetic:build",
    # Not a model: the worker runs `elastrain.workers.prepare` instead of the training loop.
    "prepare": "elastrain.workers.prepare:build",
}

#: pip requirements: a distribution name, optional extras, optional version specifiers.
#: Never an option (`--index-url ...`), a URL or a path: those would let a job pick where
#: the nodes download code from.
_VERSION = r"\s*(===|==|!=|<=|>=|~=|<|>)\s*[A-Za-z0-9.*+!_-]+"
Requirement = Annotated[
    str,
    StringConstraints(
        max_length=200,
        pattern=rf"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?(\[[A-Za-z0-9._,-]+\])?"
        rf"({_VERSION}(\s*,{_VERSION})*)?$",
    ),
]
MAX_REQUIREMENTS = 64

#: A command job's argv: what a user would put after `torchrun ...`.
MAX_COMMAND_ARGS = 256
CommandArg = Annotated[
    str, StringConstraints(max_length=4096), AfterValidator(no_control_characters)
]
#: Interpreters a command may name as its program: each rank runs it as the worker's own
#: Python (the one with torch and elastrain installed), whatever the name given.
PYTHON_NAMES = frozenset({"python", "python3"})

# "package.module:factory" (dotted module path, one colon, a Python identifier).
_ENTRYPOINT_RE = re.compile(
    r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
)

# Names and label values are printed by the CLI and the dashboard: no control characters
# (NUL, terminal escapes, bidi overrides), so what a user sees is what is stored.
ShortStr = Annotated[
    str, StringConstraints(min_length=1, max_length=100), AfterValidator(no_control_characters)
]
LabelKey = Annotated[
    str, StringConstraints(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9_.\-/]+$")
]
LabelValue = Annotated[
    str, StringConstraints(max_length=100), AfterValidator(no_control_characters)
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StrategyKind(str, Enum):
    ddp = "ddp"
    fsdp = "fsdp"
    pipeline = "pipeline"
    tp = "tp"  # tensor parallel groups, data parallel across them
    auto = "auto"  # chosen at every launch from the memory plan (contracts/plan.py)


class PipelineSchedule(str, Enum):
    gpipe = "gpipe"
    one_f_one_b = "1f1b"


class ActivationCheckpointing(str, Enum):
    none = "none"
    full = "full"
    selective = "selective"


class CheckpointDigest(str, Enum):
    """What the manifest keeps of every checkpoint file, to detect corruption before a
    load uses it (`checkpoints/manifest.py`)."""

    xxh3 = "xxh3"  # XXH3-128: non-cryptographic, memory speed; bit rot and torn files
    sha256 = "sha256"  # cryptographic, ~15x the CPU; when a policy asks for sha256


class LrSchedule(str, Enum):
    constant = "constant"
    cosine = "cosine"


class MixedPrecision(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"


class WorkloadSpec(_Strict):
    name: ShortStr | None = Field(
        default=None, description=f"A built-in workload: one of {', '.join(BUILTIN_WORKLOADS)}."
    )
    entrypoint: Annotated[str, StringConstraints(max_length=200)] | None = Field(
        default=None,
        description='A custom workload factory, "package.module:factory" (exactly one of name/entrypoint).',
    )
    command: list[CommandArg] | None = Field(
        default=None,
        max_length=MAX_COMMAND_ARGS,
        description="A script to run on every rank as under torchrun, e.g. ['python', "
        "'train.py', '--lr', '3e-4'] (exclusive with name/entrypoint): it gets RANK, "
        "WORLD_SIZE, MASTER_ADDR, ... and ELASTRAIN_JOB_DIR; a file it names comes from "
        "`package`. Its exit code ends the job; `elastrain.workers.user_api.report` charts points.",
    )
    package: Annotated[str, StringConstraints(pattern=DIGEST_RE.pattern)] | None = Field(
        default=None,
        description="An uploaded working directory ('sha256:...' from POST /v1/packages, or "
        "`elastrain submit --working-dir`): importable on every worker of every attempt, "
        "where `entrypoint` is looked up.",
    )
    requirements: list[Requirement] = Field(
        default_factory=list,
        max_length=MAX_REQUIREMENTS,
        description="pip requirements (names with optional extras and version specifiers, "
        "e.g. 'einops==0.8.1') installed for this job's workers through Ray's runtime_env.",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to the workload factory: JSON data, at most "
        f"{MAX_PARAMS_DEPTH} levels deep and {MAX_PARAMS_BYTES // 1024} KiB.",
    )

    @field_validator("params")
    @classmethod
    def _bounded_params(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if not is_stored(info):
            check_json_document(value, max_depth=MAX_PARAMS_DEPTH, max_bytes=MAX_PARAMS_BYTES)
        return value

    @property
    def runs_own_code(self) -> bool:
        """Whether the job's ranks run code of its own (an uploaded package or a custom
        entrypoint). Modules, threads, patched functions or memory it leaves in a process
        could reach the next job that process serves, so such a process serves that job
        alone and is stopped when the job ends (`elastrain.workers.runtime.pool`). Built-in
        workloads leave nothing but the job's state, dropped before another job runs there.
        A command job's code runs in child processes stopped with their attempt
        (`elastrain.workers.command`), never in the worker process itself: not its own code there."""
        if self.command is not None:
            return False
        return self.package is not None or self.entrypoint is not None

    @property
    def script_file(self) -> str | None:
        """The file a command runs, relative to its package: `train.py` of `python train.py
        ...`, or a program given as a path (`./run.sh`); None for a module (`python -m x`)
        or a program on the PATH."""
        if not self.command:
            return None
        program = self.command[0]
        if program in PYTHON_NAMES:
            first = self.command[1] if len(self.command) > 1 else None
            return first if first is not None and not first.startswith("-") else None
        return program if "/" in program or program.endswith((".py", ".sh")) else None

    @model_validator(mode="after")
    def _exactly_one_source(self, info: ValidationInfo) -> WorkloadSpec:
        if self.command is not None:
            return self._command_only()
        if (self.name is None) == (self.entrypoint is None):
            raise ValueError(
                "workload: give exactly one of 'name' (a built-in: "
                f"{', '.join(BUILTIN_WORKLOADS)}) or 'entrypoint' ('package.module:factory')"
            )
        if self.name is not None and self.name not in BUILTIN_WORKLOADS:
            raise ValueError(
                f"workload.name: unknown built-in workload {self.name!r}; "
                f"allowed: {', '.join(BUILTIN_WORKLOADS)}"
            )
        if self.name is not None and not is_stored(info):
            problems = params_problems(self.name, self.params)
            if problems:
                raise ValueError("; ".join(problems))
        if self.entrypoint is not None and not _ENTRYPOINT_RE.match(self.entrypoint):
            raise ValueError(
                f"workload.entrypoint: {self.entrypoint!r} is not of the form "
                "'package.module:factory'"
            )
        if self.package is not None and self.entrypoint is None:
            raise ValueError(
                "workload.package: needs workload.entrypoint, the 'module:factory' inside it "
                "to train (a built-in workload does not use a package)"
            )
        return self

    def _command_only(self) -> WorkloadSpec:
        """A command job: the script is the whole workload (no factory, no params)."""
        given = [f for f in ("name", "entrypoint") if getattr(self, f) is not None]
        if given:
            raise ValueError(
                f"workload.command: exclusive with workload.{given[0]} (a command runs a "
                "script; name/entrypoint build a workload for the built-in loop)"
            )
        if not self.command or not self.command[0]:
            raise ValueError(
                "workload.command: must be a non-empty list of strings starting with the "
                "program, e.g. ['python', 'train.py']"
            )
        if self.params:
            raise ValueError(
                "workload.params: a command job takes its arguments in workload.command"
            )
        script = self.script_file
        if script is not None and self.package is None:
            raise ValueError(
                f"workload.package: workload.command runs the file {script!r}, which comes "
                "from the job's package: submit with --working-dir DIR (or set "
                "workload.package to an uploaded digest)"
            )
        if script is not None and (script.startswith("/") or ".." in script.split("/")):
            raise ValueError(
                f"workload.command: {script!r} must be a path inside the job's package"
            )
        return self


_TENSOR_PARALLEL_KINDS = frozenset({"tp", "fsdp", "pipeline"})


def strategy_label(kind: StrategyKind, tensor_parallel: int = 1) -> str:
    """How status, events and plans name a strategy: 'ddp', 'tp2', 'fsdp+tp2'."""
    if kind == StrategyKind.tp:
        return f"tp{tensor_parallel}"
    return kind.value if tensor_parallel == 1 else f"{kind.value}+tp{tensor_parallel}"


class StrategySpec(_Strict):
    kind: StrategyKind = Field(
        default=StrategyKind.ddp,
        description="ddp | fsdp | pipeline | tp | auto (the memory plan picks ddp, fsdp, tp "
        "or fsdp+tp at every launch, for the world size it launches at; built-in workloads "
        "only)",
    )
    tensor_parallel: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="tensor-parallel degree: ranks that split each layer (tp: default 2; "
        "with fsdp: 2-D; with pipeline: 3-D). Fixed for the job; the world size is "
        "data-parallel replicas x pipeline stages x this",
    )
    pipeline_stages: int | None = Field(default=None, ge=1, le=64, description="pipeline only")
    microbatches: int | None = Field(default=None, ge=1, le=1024, description="pipeline only")
    schedule: PipelineSchedule | None = Field(
        default=None, description="pipeline only: gpipe | 1f1b"
    )
    mixed_precision: MixedPrecision | None = Field(
        default=None, description="null | bf16 | fp16 (GPU)"
    )
    cpu_offload: bool = Field(
        default=False,
        description="fsdp only (GPU): keep the sharded parameters, gradients and optimizer "
        "state in host memory; the device holds the units being computed",
    )

    @model_validator(mode="after")
    def _pipeline_options(self) -> StrategySpec:
        pipeline_only = {
            "pipeline_stages": self.pipeline_stages,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
        }
        if self.kind != StrategyKind.pipeline:
            given = [k for k, v in pipeline_only.items() if v is not None]
            if given:
                raise ValueError(
                    f"strategy.{given[0]}: only allowed when strategy.kind is 'pipeline' "
                    f"(kind is {self.kind.value!r})"
                )
        if self.cpu_offload and self.kind != StrategyKind.fsdp:
            raise ValueError(
                f"strategy.cpu_offload: only allowed when strategy.kind is 'fsdp' (kind is "
                f"{self.kind.value!r})"
            )
        if self.tensor_parallel is not None and self.kind not in _TENSOR_PARALLEL_KINDS:
            hint = (
                " (for DDP-style replicas of a tensor-parallel model use kind 'tp')"
                if self.kind == StrategyKind.ddp
                else ""
            )
            raise ValueError(
                f"strategy.tensor_parallel: only allowed with kind tp, fsdp or pipeline "
                f"(kind is {self.kind.value!r}){hint}"
            )
        return self

    @property
    def tensor_parallel_degree(self) -> int:
        if self.tensor_parallel is not None:
            return self.tensor_parallel
        return 2 if self.kind == StrategyKind.tp else 1

    @property
    def label(self) -> str:
        return strategy_label(self.kind, self.tensor_parallel_degree)

    @property
    def model_parallel_size(self) -> int:
        """Ranks one model replica spans (stages x tensor-parallel degree): the job runs
        at multiples of it only."""
        stages = self.stages if self.kind == StrategyKind.pipeline else 1
        return stages * self.tensor_parallel_degree

    # Defaults for a pipeline job, filled when the field is left out.
    @property
    def stages(self) -> int:
        return self.pipeline_stages or 2

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or 4

    @property
    def pipeline_schedule(self) -> PipelineSchedule:
        return self.schedule or PipelineSchedule.one_f_one_b


#: The most workers one job may ask for: more ranks than any cluster we schedule on holds,
#: and few enough that the scheduler's per-size arithmetic stays cheap.
MAX_WORKERS = 1024
#: A worker is a process with torch loaded: below a hundredth of a CPU it is not a share of
#: a CPU any more but a way to claim a thousand workers on none (and Ray rounds resources
#: to 1/10000, so smaller values become 0 there).
MIN_CPUS_PER_WORKER = 0.01
MAX_CPUS_PER_WORKER = 512


class ScalingSpec(_Strict):
    min_workers: int = Field(default=1, ge=1, le=MAX_WORKERS)
    max_workers: int = Field(default=2, ge=1, le=MAX_WORKERS)
    use_gpu: bool = False
    cpus_per_worker: float = Field(
        default=1,
        ge=MIN_CPUS_PER_WORKER,
        le=MAX_CPUS_PER_WORKER,
        allow_inf_nan=False,
        description=f"CPUs each worker holds ({MIN_CPUS_PER_WORKER:g}..{MAX_CPUS_PER_WORKER}).",
    )
    gpus_per_worker: float = Field(
        default=0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="GPUs each worker holds: 0 without use_gpu, 1 with it (a rank runs in a "
        "warm process that owns one GPU; no shares, no second GPU).",
    )

    @model_validator(mode="after")
    def _range(self) -> ScalingSpec:
        if self.min_workers > self.max_workers:
            raise ValueError(
                f"scaling.min_workers ({self.min_workers}) must be <= scaling.max_workers "
                f"({self.max_workers})"
            )
        if self.use_gpu and self.gpus_per_worker != 1:
            # A rank runs in a warm process that owns one GPU for its lifetime (two ranks
            # of one NCCL group cannot share a GPU; a second GPU would sit unused).
            raise ValueError(
                "scaling.gpus_per_worker: must be 1 when scaling.use_gpu is true (each rank "
                "runs in a worker process that owns one GPU)"
            )
        if not self.use_gpu and self.gpus_per_worker > 0:
            raise ValueError("scaling.gpus_per_worker: must be 0 when scaling.use_gpu is false")
        return self


class TrainingSpec(_Strict):
    global_batch_size: int = Field(
        default=32, ge=1, le=1_000_000, description="fixed whatever the world size"
    )
    micro_batch_size: int = Field(default=8, ge=1, le=1_000_000)
    learning_rate: float = Field(default=3e-4, gt=0, le=10, description="the peak learning rate")
    lr_schedule: LrSchedule = Field(
        default=LrSchedule.constant,
        description="constant | cosine: linear warm-up for warmup_steps, then cosine decay "
        "to min_lr at max_steps (warm-up applies to both)",
    )
    warmup_steps: int = Field(default=0, ge=0, le=100_000_000)
    min_lr: float = Field(default=0.0, ge=0, le=10, description="cosine only: the final lr")
    weight_decay: float = Field(default=0.01, ge=0, le=10, description="AdamW's (decoupled)")
    grad_clip: float | None = Field(
        default=1.0, gt=0, le=1e6, description="max global gradient norm; null: no clipping"
    )
    eval_every: int | None = Field(
        default=None,
        ge=1,
        le=100_000_000,
        description="evaluate on the workload's held-out split every this many steps (and "
        "at the end), reporting eval_loss; null: never",
    )
    eval_samples: int = Field(
        default=256, ge=1, le=1_000_000, description="held-out samples per evaluation"
    )
    activation_checkpointing: ActivationCheckpointing = Field(
        default=ActivationCheckpointing.none,
        description="none | full (recompute every block in backward) | selective (every "
        "second block): less activation memory for more compute",
    )
    max_steps: int = Field(default=200, ge=1, le=100_000_000)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    compile: bool = Field(
        default=False,
        description="torch.compile each of the model's blocks (its shard_units), as "
        "torchtitan does: faster steps once compiled. A process's first step compiles "
        "(seconds to minutes); a later attempt in the same warm process reuses it",
    )

    @model_validator(mode="after")
    def _divisible(self) -> TrainingSpec:
        if self.global_batch_size % self.micro_batch_size != 0:
            raise ValueError(
                f"training.global_batch_size ({self.global_batch_size}) must be divisible by "
                f"training.micro_batch_size ({self.micro_batch_size})"
            )
        if self.warmup_steps >= self.max_steps:
            raise ValueError(
                f"training.warmup_steps ({self.warmup_steps}) must be < training.max_steps "
                f"({self.max_steps})"
            )
        if self.min_lr > self.learning_rate:
            raise ValueError(
                f"training.min_lr ({self.min_lr}) must be <= training.learning_rate "
                f"({self.learning_rate})"
            )
        if self.min_lr > 0 and self.lr_schedule == LrSchedule.constant:
            raise ValueError("training.min_lr: only used by lr_schedule 'cosine'")
        return self


class CheckpointSpec(_Strict):
    every_steps: int = Field(default=20, ge=1, le=10_000_000)
    keep_last: int = Field(
        default=3, ge=2, le=1000, description=">= 2: the newest is never the only one"
    )
    async_save: bool = True
    digest: CheckpointDigest = Field(
        default=CheckpointDigest.xxh3,
        description="Digest of every checkpoint file kept in its manifest and checked at "
        "load: 'xxh3' (XXH3-128, fast, detects corruption) or 'sha256' (cryptographic, "
        "slower). Checkpoints load whichever their manifest names.",
    )
    memory_every: int | None = Field(
        default=None,
        ge=0,
        le=10_000_000,
        description=(
            "steps between refreshes of each rank's state and its buddy's copy in host "
            "memory (sharded strategies; ddp survivors hold whole replicas anyway). null: "
            "every step when that costs <= 5% of step time as measured, else the smallest "
            "interval that does; 0: off (node loss resumes from the checkpoint). Refreshes "
            "fall on the interval's multiples"
        ),
    )


class StragglerAction(str, Enum):
    report = "report"
    evict = "evict"


class FailureSpec(_Strict):
    max_restarts: int = Field(default=5, ge=0, le=1000)
    hang_after_s: float | None = Field(
        default=None,
        ge=1,
        le=86_400,
        description="a rank that makes no progress this long (a frozen process, a collective "
        "that never returns, a data loader or user code stuck) is hung: the attempt is "
        "aborted and retried as a failure. null: max(10 s, 5x the attempt's median step "
        "time). Watched from an attempt's first step on (a first step may compile or "
        "warm up for minutes); not for workload.command scripts",
    )
    stragglers: StragglerAction = Field(
        default=StragglerAction.report,
        description="a rank whose local work per step (its batch and its update: the part "
        "of a step no peer paces) stays above the ranks' median by more than "
        "straggler_threshold over straggler_window steps is a straggler. report: an event, "
        "a mark on the job page and a Prometheus gauge. evict: also leave its node at the "
        "next step boundary, as a drain would (state in memory, no restart counted), keep "
        "off it for straggler_cooldown_s, then grow back onto it",
    )
    straggler_threshold: float = Field(
        default=0.25, gt=0, le=10, description="how far above the median (0.25: 25 %)"
    )
    straggler_window: int = Field(
        default=20, ge=5, le=200, description="steps a rank must stay above it"
    )
    straggler_cooldown_s: float = Field(
        default=600, ge=0, le=7 * 86_400, description="evict: how long the job keeps off the node"
    )


#: Where an MLflow tracking server or store lives: a scheme MLflow understands, no
#: whitespace or control characters. The control plane connects there, not the workers.
_TRACKING_URI_RE = r"^(file|http|https|sqlite|postgresql|mysql|databricks)(\+[a-z0-9]+)?:[^\s]*$"
#: W&B project names: what wandb itself accepts in a project slug.
_WANDB_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"


class WandbMode(str, Enum):
    offline = "offline"  # run files under WANDB_DIR on the control plane (`wandb sync` later)
    online = "online"  # straight to the W&B server (the control plane holds WANDB_API_KEY)


class MlflowTracking(_Strict):
    tracking_uri: (
        Annotated[str, StringConstraints(min_length=1, max_length=500, pattern=_TRACKING_URI_RE)]
        | None
    ) = Field(
        default=None,
        description="MLflow server the control plane forwards to: null for the operator's "
        "tracker (ELASTRAIN_MLFLOW_TRACKING_URI), else an http(s) server on the operator's "
        "list (ELASTRAIN_TRACKING_ALLOWED_URIS); file paths and databases are refused",
    )
    experiment: ShortStr = Field(
        default="elastrain", description="experiment name (created when missing)"
    )


class WandbTracking(_Strict):
    project: Annotated[
        str, StringConstraints(min_length=1, max_length=128, pattern=_WANDB_NAME_RE)
    ] = Field(description="W&B project")
    entity: (
        Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=_WANDB_NAME_RE)]
        | None
    ) = Field(default=None, description="W&B entity (team or user); null: the key's default")
    mode: WandbMode = Field(
        default=WandbMode.online,
        description="online | offline (run files under the control plane's WANDB_DIR)",
    )


#: The tracker names of `TrackingSpec`, each with the extra that installs its client.
TRACKER_EXTRAS: dict[str, tuple[str, str]] = {
    "mlflow": ("mlflow", "elastrain[mlflow]"),
    "wandb": ("wandb", "elastrain[wandb]"),
}


class TrackingSpec(_Strict):
    """Experiment trackers the control plane forwards the job's metrics, params (the spec,
    flattened) and lifecycle to. The workers never talk to a tracker, so they need no
    tracker credentials; a tracker that fails never fails the job."""

    mlflow: MlflowTracking | None = None
    wandb: WandbTracking | None = None

    @property
    def names(self) -> list[str]:
        return [name for name in TRACKER_EXTRAS if getattr(self, name) is not None]


class JobSpec(_Strict):
    name: ShortStr
    workload: WorkloadSpec
    strategy: StrategySpec = Field(default_factory=StrategySpec)
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    failure: FailureSpec = Field(default_factory=FailureSpec)
    priority: int = Field(default=0, ge=-1000, le=1000, description="higher runs first")
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec,
        description="experiment trackers to forward metrics, params and lifecycle to: "
        "{mlflow: {tracking_uri, experiment}} and/or {wandb: {project, mode}}",
    )

    @model_validator(mode="after")
    def _cross_field(self, info: ValidationInfo) -> JobSpec:
        stored = is_stored(info)  # accepted at submit: only structure is checked again
        group = self.strategy.model_parallel_size
        if group > self.scaling.max_workers:
            raise ValueError(
                f"{self._group_fields()} ({self._group_words()}) must be <= "
                f"scaling.max_workers ({self.scaling.max_workers})"
            )
        if group > 1 and not self.world_sizes and not stored:
            # Accepted, such a job would wait forever for a size no cluster can give it.
            lo, hi = self.scaling.min_workers, self.scaling.max_workers
            raise ValueError(
                f"scaling: {self._group_words()} runs on a multiple of {group} workers, and "
                f"none lies in min_workers..max_workers ({lo}..{hi}); lower "
                f"scaling.min_workers to {lo - lo % group} or raise scaling.max_workers to "
                f"{lo + (-lo) % group}"
            )
        if (
            self.strategy.kind == StrategyKind.pipeline
            and not stored
            and (why := self._no_pipeline_split())
        ):
            raise ValueError(f"strategy.pipeline_stages: {why}")
        if self.strategy.tensor_parallel_degree > 1 and (why := self._no_tensor_parallel()):
            raise ValueError(f"strategy.tensor_parallel: {why}")
        if self.workload.name == "prepare" and (why := self._not_one_preparer()):
            raise ValueError(why)
        if self.training.compile and self.workload.command is not None:
            raise ValueError(
                "training.compile: a command job's script compiles its own model; set it "
                "false and call torch.compile in the script"
            )
        if self.training.compile and self.strategy.kind == StrategyKind.pipeline:
            raise ValueError(
                "training.compile: not supported with kind 'pipeline' yet; use ddp, fsdp "
                "or tp, or compile: false"
            )
        if self.workload.command is not None and self.strategy != StrategySpec():
            raise ValueError(
                "strategy: a command job's script does its own parallelism (every rank runs "
                "it, as under torchrun); leave strategy out"
            )
        if self.strategy.kind == StrategyKind.auto and self.workload.name in (
            None,
            "hf_causal_lm",  # its size is known once transformers has built it
        ):
            raise ValueError(
                "strategy.kind: 'auto' plans from the model's size, known before it runs only "
                "for the gpt and synthetic workloads; choose ddp, fsdp or pipeline"
            )
        if (
            self.training.eval_every is not None
            and not stored
            and (why := self._no_held_out_split())
        ):
            raise ValueError(f"training.eval_every: {why}")
        if self.strategy.cpu_offload and not self.scaling.use_gpu:
            raise ValueError(
                "strategy.cpu_offload: offloads from a GPU to host memory; set "
                "scaling.use_gpu: true, or cpu_offload: false (a CPU job's state is in host "
                "memory already)"
            )
        if (
            self.strategy.mixed_precision == MixedPrecision.fp16
            and self.strategy.kind == StrategyKind.pipeline
            and not stored  # one stored before this rule fails on its workers, not here
        ):
            # fp16 would need loss scaling inside the schedule's backward.
            raise ValueError(
                "strategy.mixed_precision: pipeline stages train in bf16, not fp16; set "
                "mixed_precision: bf16"
            )
        if self.strategy.mixed_precision is not None and not self.scaling.use_gpu:
            raise ValueError(
                "strategy.mixed_precision: bf16/fp16 needs a GPU; set scaling.use_gpu: true "
                "or mixed_precision: null"
            )
        return self

    def _not_one_preparer(self) -> str | None:
        """Why a `prepare` job's spec cannot run: it is one worker process (Ray Data spreads
        the tokenizing over the cluster's CPUs), with no model to split or evaluate."""
        if self.scaling.max_workers != 1 or self.scaling.use_gpu:
            return (
                "scaling.max_workers: a prepare job runs on exactly one CPU worker (Ray Data "
                "spreads its work over the cluster); set min_workers and max_workers to 1 "
                "and use_gpu false"
            )
        if self.strategy != StrategySpec() or self.training.compile:
            return "strategy: a prepare job trains no model; leave strategy and compile out"
        if self.training.eval_every is not None:
            return "training.eval_every: a prepare job trains no model; leave it out"
        return None

    def _group_fields(self) -> str:
        pipeline = self.strategy.kind == StrategyKind.pipeline
        tp = self.strategy.tensor_parallel_degree > 1
        if pipeline and tp:
            return "strategy.pipeline_stages x strategy.tensor_parallel"
        return "strategy.pipeline_stages" if pipeline else "strategy.tensor_parallel"

    def _group_words(self) -> str:
        """One model replica's ranks in words: 'a pipeline of 2 stages', ..."""
        stages, tp = self.strategy.stages, self.strategy.tensor_parallel_degree
        if self.strategy.kind != StrategyKind.pipeline:
            return f"a model split over {tp} tensor-parallel ranks"
        if tp == 1:
            return f"a pipeline of {stages} stages"
        return f"a pipeline of {stages} stages x {tp} tensor-parallel ranks = {stages * tp}"

    def _no_pipeline_split(self) -> str | None:
        """Why a built-in workload's model cannot be cut into the pipeline's stages (None:
        it can, or it is a custom workload, which says so when it is built). Each stage
        takes whole blocks (`elastrain.workers.workloads.stage_block_range`)."""
        if self.workload.name not in BUILTIN_PARAMS:
            return None
        if self.workload.name == "hf_causal_lm":
            return (
                "the hf_causal_lm workload has no pipeline split; use ddp, fsdp or tp "
                "(strategy.tensor_parallel)"
            )
        blocks = BUILTIN_PARAMS[self.workload.name].model_validate(self.workload.params)
        n_layer = int(getattr(blocks, "n_layer", 0))
        stages = self.strategy.stages
        if stages > n_layer:
            return (
                f"{stages} stages, but the {self.workload.name} model has {n_layer} blocks "
                f"(workload.params.n_layer) and a stage takes whole blocks: at most {n_layer} "
                "stages, or more layers"
            )
        return None

    def _no_tensor_parallel(self) -> str | None:
        """Why a built-in workload cannot be split `tensor_parallel` ways (None: it can,
        or it is a custom workload, which says so when it is built).

        The gpt's plan (`GPT.tensor_parallel_plan`) splits each block's heads (so n_head,
        and with it n_embd = n_head x head size and the MLP's 4 x n_embd, must divide) and
        the embeddings' and LM head's rows (vocabulary, positions): DTensor shards those
        unevenly, any size at any degree (tests/unit/test_tensor_parallel.py), so nothing
        else is refused. The world size must be a multiple of the degree: `_cross_field`."""
        tp = self.strategy.tensor_parallel_degree
        if self.workload.name == "synthetic":
            return "the synthetic workload has no tensor-parallel plan (the gpt has)"
        if self.workload.name == "gpt":
            n_head = GptParams.model_validate(self.workload.params).n_head
            if n_head % tp:
                return (
                    f"{tp} must divide workload.params.n_head ({n_head}): each rank runs "
                    "whole attention heads"
                )
        if self.workload.name == "hf_causal_lm":
            config = HfCausalLmParams.model_validate(self.workload.params).config or {}
            for key in ("num_attention_heads", "num_key_value_heads"):
                heads = config.get(key)
                if isinstance(heads, int) and heads % tp:
                    return (
                        f"{tp} must divide workload.params.config.{key} ({heads}): each "
                        "rank runs whole attention heads"
                    )
        return None

    def _no_held_out_split(self) -> str | None:
        """Why a built-in workload has nothing to evaluate on (None: it has, or it is a
        custom workload, which says so when it is built)."""
        if self.workload.name == "synthetic":
            return "the synthetic workload has no held-out split"
        if (
            self.workload.name == "hf_causal_lm"
            and not HfCausalLmParams.model_validate(self.workload.params).has_held_out
        ):
            return (
                "the hf_causal_lm has no held-out split: set workload.params.eval_fraction, "
                "or eval_path with a data_path"
            )
        if (
            self.workload.name == "gpt"
            and not GptParams.model_validate(self.workload.params).has_held_out
        ):
            return (
                "the gpt has no held-out split: set workload.params.eval_fraction (the end "
                "of the corpus), or eval_path with a data_path"
            )
        return None

    @classmethod
    def from_stored(cls, data: dict[str, Any]) -> JobSpec:
        """A spec as the database holds it: accepted at submit, so the input bounds added
        since (control characters, params size) are not applied again; the structure is."""
        return cls.model_validate(data, context=STORED)

    @property
    def min_world_size(self) -> int:
        """The smallest world size the job can run at (one whole model replica: all of a
        pipeline's stages, all tensor-parallel ranks)."""
        return max(self.scaling.min_workers, self.strategy.model_parallel_size)

    @property
    def world_sizes(self) -> list[int]:
        """Every world size the job can run at, smallest first."""
        return [
            n
            for n in range(self.min_world_size, self.scaling.max_workers + 1)
            if self.usable_world_size(n) == n
        ]

    def usable_world_size(self, capacity: int) -> int:
        """The largest world size <= capacity the job can use, or 0 when below its minimum.

        Pipeline and tensor-parallel jobs run whole replicas only (a multiple of the
        stage count times the tensor-parallel degree).
        """
        size = min(capacity, self.scaling.max_workers)
        size -= size % self.strategy.model_parallel_size
        return size if size >= self.min_world_size else 0
