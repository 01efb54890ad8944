"""Workloads: what to train. Built-ins (`gpt`, `synthetic`) or a user's `module:function`.

A workload factory takes the spec's `workload.params` as keyword arguments and returns a
`elastrain.workers.api.Workload` (model on CPU, indexable dataset, mean-reduced loss function).
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from elastrain.contracts.bounds import OWN_PACKAGES, in_standard_library, private_part
from elastrain.contracts.datasets import DataPathError, resolve_under
from elastrain.contracts.spec import BUILTIN_WORKLOADS, WorkloadSpec
from elastrain.workers.api import Workload, WorkloadFactory


class WorkloadError(ValueError):
    """The spec's workload cannot be built; the message names the spec field to fix."""


def load_workload(spec: WorkloadSpec, *, storage_root: Path | None = None) -> Workload:
    """Build the workload the spec's `workload` section describes: a built-in by name
    (`elastrain.contracts.spec.BUILTIN_WORKLOADS`) or a user's `module:function`, called with
    `params` as keyword arguments. The gpt's data paths are resolved under `storage_root`:
    the control plane hands them over relative to it, already confined to the job owner's
    data area (`elastrain.contracts.datasets.storage_relative_data_paths`)."""
    entrypoint = BUILTIN_WORKLOADS[spec.name] if spec.name is not None else spec.entrypoint
    if entrypoint is None:  # WorkloadSpec validates exactly one; a model_construct may not
        raise WorkloadError("workload: give exactly one of 'name' or 'entrypoint'")
    if spec.name is None and (why := custom_entrypoint_refusal(entrypoint)) is not None:
        # The API refuses these at submit; a job stored before that rule must not run one.
        raise WorkloadError(f"workload.entrypoint: {why}")
    params = dict(spec.params)
    if spec.name == "gpt" and storage_root is not None:
        for key in ("data_path", "eval_path"):
            if isinstance(params.get(key), str):
                try:
                    params[key] = str(resolve_under(params[key], storage_root))
                except DataPathError as exc:
                    raise WorkloadError(f"workload.params.{key}: {exc}") from exc
    factory = resolve_entrypoint(entrypoint)
    try:
        inspect.signature(factory).bind(**params)
    except TypeError as exc:
        raise WorkloadError(f"workload.params do not fit {entrypoint}: {exc}") from exc
    except ValueError:
        pass  # no introspectable signature (a C callable): let the call itself complain
    try:
        workload = factory(**params)
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
