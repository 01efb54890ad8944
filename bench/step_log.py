"""Training hooks for the baselines that run without the service (Ray Train, torchrun):
rank 0 appends each step's wall clock to `folder/steps.jsonl`; a `folder/stop` file asks
the loop to stop. Free of Ray, so torchrun's cold start does not pay for importing it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from elastrain.contracts.messages import Control, StepMetrics


class FileHooks:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def send(self, message: Any) -> None:
        if isinstance(message, StepMetrics):
            point = message.to_point()
            with (self.folder / "steps.jsonl").open("a") as f:
                f.write(json.dumps({k: point[k] for k in ("step", "wall_time", "world_size")}))
                f.write("\n")

    def poll_control(self) -> Control:
        return Control.STOP if (self.folder / "stop").exists() else Control.NONE

    def undelivered(self) -> list[StepMetrics]:
        return []  # written at once: nothing to keep for the service


class SilentHooks(FileHooks):
    """Ranks other than 0: only the stop file."""

    def send(self, message: Any) -> None: ...
