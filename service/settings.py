"""Service configuration: one `Settings` object read from `ELASTRAIN_*` environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_HOME = Path(".elastrain")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ELASTRAIN_", extra="ignore")

    database_url: str = Field(
        default=f"sqlite:///{_HOME / 'elastrain.db'}",
        description="SQLAlchemy URL; SQLite file by default, postgresql+psycopg://... in production.",
    )
    ray_address: str | None = Field(
        default=None, description="Address of an existing Ray cluster; unset starts a local Ray."
    )
    storage_path: Path = Field(
        default=_HOME / "storage",
        description="Checkpoints and worker logs; must be shared by every Ray node.",
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)

    # Scheduler tuning. The loop is level-triggered: each pass is cheap, so a short
    # interval buys fast reaction to node loss without extra machinery.
    scheduler_interval_s: float = Field(default=0.5, gt=0)
    grow_interval_s: float = Field(
        default=10.0, ge=0, description="How long spare capacity must last before a job grows."
    )
    below_min_timeout_s: float = Field(
        default=600.0, gt=0, description="How long a job may wait below min_workers before failing."
    )
    restart_backoff_s: float = Field(default=1.0, ge=0)
    ray_namespace: str = "elastrain"
    ray_num_cpus: int | None = Field(
        default=None, description="CPUs of the local Ray (unset: all)."
    )
    warm_workers_per_node: int = Field(
        default=2,
        ge=0,
        description="Idle worker processes (torch imported) kept on every node ahead of need.",
    )
    collective_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="How long a rank waits in a collective (or for its peers to rendezvous) "
        "before it gives up; a dead peer is noticed at once, a partitioned one after this.",
    )

    api_token: str | None = Field(
        default=None,
        description="When set, every /v1 request needs 'Authorization: Bearer <token>'.",
    )

    @field_validator("storage_path")
    @classmethod
    def _absolute_storage(cls, value: Path) -> Path:
        # Ray workers and the Ray Train controller run with other working directories,
        # and Ray Train refuses relative storage paths: resolve once, here.
        return value.expanduser().resolve()

    def ensure_dirs(self) -> None:
        self.storage_path.mkdir(parents=True, exist_ok=True)
        if self.database_url.startswith("sqlite:///"):
            db_file = Path(self.database_url.removeprefix("sqlite:///"))
            db_file.parent.mkdir(parents=True, exist_ok=True)
