"""elastrain: an elastic PyTorch training service on Ray.

Users import this name only: `elastrain.Workload` (what a custom workload factory returns),
`elastrain.report(step=..., loss=..., **metrics)` (points on the dashboard from a script run
as a job) and `elastrain.job_dir()` (the job's folder on shared storage). The service's
own parts live below it (`elastrain.service`, `elastrain.workers`, `elastrain.api`,
`elastrain.contracts`, `elastrain.checkpoints`), so a training project may have modules or
folders of any of those names.

Names resolve on first use: `import elastrain` loads neither torch nor Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastrain.workers.api import SampleDataset, Workload
    from elastrain.workers.user_api import job_dir, report

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_PUBLIC = {
    "Workload": "elastrain.workers.api",
    "SampleDataset": "elastrain.workers.api",
    "report": "elastrain.workers.user_api",
    "job_dir": "elastrain.workers.user_api",
}

__all__ = ["SampleDataset", "Workload", "__version__", "job_dir", "report"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'elastrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
