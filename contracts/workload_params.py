"""The built-in workloads' parameters, typed: checked at submit, not discovered by a worker.

Torch-free, so the API validates `workload.params` of a `gpt` or `synthetic` job the moment
it is submitted: an unknown key, a wrong type or an impossible value is a 422 that names
`workload.params.<key>` and what is allowed, instead of an attempt that fails on a worker
and burns restarts. The workers build the workloads with these same fields
(`workers/workloads/`); a test checks that the two agree.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

Count = Annotated[StrictInt, Field(ge=1)]


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GptParams(_Params):
    """A character-level GPT on the bundled tiny Shakespeare corpus."""

    n_layer: Annotated[Count, Field(le=128)] = 4
    n_embd: Annotated[Count, Field(le=16384)] = 128
    n_head: Annotated[Count, Field(le=256)] = 4
    seq_len: Annotated[Count, Field(le=65536)] = 64
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    stride: Annotated[Count, Field(le=65536)] | None = None

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GptParams:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"workload.params.n_embd ({self.n_embd}) must be divisible by "
                f"workload.params.n_head ({self.n_head})"
            )
        return self


class SyntheticParams(_Params):
    """MSE regression on seeded random data (tests and benchmarks)."""

    num_samples: Annotated[Count, Field(le=100_000_000)] = 4096
    in_dim: Annotated[Count, Field(le=65536)] = 16
    hidden: Annotated[Count, Field(le=65536)] = 64
    out_dim: Annotated[Count, Field(le=65536)] = 4
    n_layer: Annotated[Count, Field(le=128)] = 4
    data_seed: Annotated[StrictInt, Field(ge=0, le=2**31 - 1)] = 1234


BUILTIN_PARAMS: dict[str, type[_Params]] = {"gpt": GptParams, "synthetic": SyntheticParams}


def params_problems(workload: str, params: dict[str, Any]) -> list[str]:
    """What is wrong with `params` for the built-in `workload`, one line per problem, each
    starting with `workload.params.<key>` ([] when they are fine)."""
    model = BUILTIN_PARAMS[workload]
    try:
        model.model_validate(params)
    except ValidationError as exc:
        allowed = ", ".join(model.model_fields)
        problems = []
        for error in exc.errors():
            key = ".".join(str(p) for p in error["loc"])
            msg = str(error["msg"]).removeprefix("Value error, ")
            if not key:  # a check across fields: its message names them
                problems.append(msg)
            elif error["type"] == "extra_forbidden":
                problems.append(
                    f"workload.params.{key}: unknown parameter of {workload!r}; allowed: {allowed}"
                )
            else:
                problems.append(f"workload.params.{key}: {msg}")
        return problems
    return []
