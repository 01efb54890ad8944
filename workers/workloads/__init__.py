"""Workloads: what to train. Built-ins (`gpt`, `hf_causal_lm`, `synthetic`) or a user's
`module:function`.

A factory returns a `elastrain.workers.api.Workload` (model on CPU, indexable dataset,
mean-reduced loss function). A built-in's takes its typed params, the model of
`elastrain.contracts.workload_params` (which holds their defaults); a user's takes the
spec's `workload.params` as keyword arguments.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from elastrain.contracts.bounds import OWN_PACKAGES, in_standard_library, private_part
from elastrain.contracts.datasets import DATA_WORKLOADS, PATH_PARAMS, DataPathError, resolve_under
from elastrain.contracts.spec import BUILTIN_WORKLOADS, WorkloadSpec
from elastrain.contracts.workload_params import BUILTIN_PARAMS, params_problems
from elastrain.workers.api import Workload, WorkloadFactory


class WorkloadError(ValueError):
    """The spec's workload cannot be built; the message names the spec field to fix."""


def load_workload(spec: WorkloadSpec, *, storage_root: Path | None = None) -> Workload:
    """Build the workload the spec's `workload` section describes: a built-in by name
    (`elastrain.contracts.spec.BUILTIN_WORKLOADS`), called with its typed params, or a user's
    `module:function`, called with `params` as keyword arguments. The gpt's data paths are
    resolved under `storage_root`: the control plane hands them over relative to it, already
    confined to the job owner's data area
    (`elastrain.contracts.datasets.storage_relative_data_paths`)."""
    entrypoint = BUILTIN_WORKLOADS[spec.name] if spec.name is not None else spec.entrypoint
    if entrypoint is None:  # WorkloadSpec validates exactly one; a model_construct may not
        raise WorkloadError("workload: give exactly one of 'name' or 'entrypoint'")
    if spec.name is None and (why := custom_entrypoint_refusal(entrypoint)) is not None:
        # The API refuses these at submit; a job stored before that rule must not run one.
        raise WorkloadError(f"workload.entrypoint: {why}")
    params = dict(spec.params)
    if spec.name in DATA_WORKLOADS and storage_root is not None:
        for key in PATH_PARAMS:
            if isinstance(params.get(key), str):
                try:
                    params[key] = str(resolve_under(params[key], storage_root))
                except DataPathError as exc:
                    raise WorkloadError(f"workload.params.{key}: {exc}") from exc
    factory = resolve_entrypoint(entrypoint)
    args: tuple[BaseModel, ...] = ()
    if spec.name is not None:
        args, params = (builtin_params(spec.name, params),), {}
    else:
        try:
            inspect.signature(factory).bind(**params)
        except TypeError as exc:
            raise WorkloadError(f"workload.params do not fit {entrypoint}: {exc}") from exc
        except ValueError:
            pass  # no introspectable signature (a C callable): let the call itself complain
    try:
        workload = factory(*args, **params)
    except WorkloadError:
        raise
    except Exception as exc:
        # A factory that cannot build the workload from these params will not build it on a
        # retry either: a configuration error, with the factory's own words.
        raise WorkloadError(
            f"workload: {entrypoint} raised {type(exc).__name__} while building: {exc}"
        ) from exc
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"workload.entrypoint: {entrypoint} returned {type(workload).__name__}, "
            "expected elastrain.workers.api.Workload"
        )
    return workload


def builtin_params(name: str, params: Mapping[str, Any]) -> BaseModel:
    """The built-in workload `name`'s params, typed: checked at submit already, and again
    here for a spec stored before they were, in the words the submit would have used."""
    try:
        return BUILTIN_PARAMS[name].model_validate(params)
    except ValidationError as exc:
        raise WorkloadError("; ".join(params_problems(name, dict(params)))) from exc


def custom_entrypoint_refusal(entrypoint: str) -> str | None:
    """Why a custom entrypoint may not run on a worker whatever the operator allows: the
    service's own modules (built-ins are named, and checked, by `workload.name`), or a
    private name."""
    module = entrypoint.partition(":")[0]
    if module.split(".")[0] in OWN_PACKAGES:
        return f"module {module!r} is elastrain's own; give a built-in workload by name"
    if (private := private_part(entrypoint)) is not None:
        return f"{private!r} is private; only public factories can run"
    return None


def resolve_entrypoint(entrypoint: str) -> WorkloadFactory:
    """'package.module:function' -> the function, with errors that say what is missing."""
    module_name, sep, attr = entrypoint.partition(":")
    if not sep or not module_name or not attr:
        raise WorkloadError(f"workload.entrypoint: {entrypoint!r} is not 'package.module:factory'")
    if in_standard_library(module_name):
        raise WorkloadError(
            f"workload.entrypoint: {module_name!r} is in the standard library; refused"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise WorkloadError(
            f"workload.entrypoint: cannot import module {module_name!r} ({exc}); is it "
            "installed on the workers?"
        ) from exc
    except Exception as exc:
        # The module's own top-level code failed: it will fail the same on every retry.
        raise WorkloadError(
            f"workload.entrypoint: importing module {module_name!r} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise WorkloadError(f"workload.entrypoint: module {module_name!r} has no callable {attr!r}")
    return factory


def stage_block_range(n_blocks: int, stage_index: int, num_stages: int) -> tuple[int, int]:
    """Blocks [lo, hi) that pipeline stage `stage_index` of `num_stages` runs: as even as
    possible, earlier stages take the remainder."""
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} not in [0, {num_stages})")
    if num_stages > n_blocks:
        raise ValueError(f"cannot split {n_blocks} blocks over {num_stages} pipeline stages")
    base, extra = divmod(n_blocks, num_stages)
    lo = stage_index * base + min(stage_index, extra)
    return lo, lo + base + (1 if stage_index < extra else 0)
