"""Service configuration: one `Settings` object read from `ELASTRAIN_*` environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from sqlalchemy.engine import make_url

from elastrain.contracts.bounds import OWN_PACKAGES, in_standard_library
from elastrain.contracts.os_identity import RunAs, parse_tenant_users
from elastrain.contracts.packages import PackageLimits
from elastrain.service.metric_limits import MetricLimits

_HOME = Path(".elastrain")
#: Shorter tokens are guessable; the ones `elastrain token create` makes are 43 characters.
MIN_TOKEN_LENGTH = 16


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
    # What one client may hold of the HTTP server (api/http_guard.py).
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="Most bytes of a request's headers; past them a 431 and the connection closed.",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A request's headers (and a new connection's first) must arrive within "
        "this long, else a 408 and the connection closed (slow and half-open clients).",
    )
    keep_alive_s: int = Field(
        default=5, ge=1, description="An idle keep-alive connection closes after this long."
    )
    max_connections: int = Field(
        default=2048,
        ge=1,
        description="Most open connections per API process; past it the oldest one still "
        "waiting for its headers is closed to make room (or the new one gets a 503).",
    )

    # Scheduler tuning. The loop is level-triggered: each pass is cheap, so a short
    # interval buys fast reaction to node loss without extra machinery.
    scheduler_interval_s: float = Field(default=0.5, gt=0)
    tracking_interval_s: float = Field(
        default=2.0,
        gt=0,
        description="How often the control plane forwards new metric points and state "
        "changes of tracked jobs (spec `tracking`) to their experiment trackers.",
    )
    grow_interval_s: float = Field(
        default=10.0, ge=0, description="How long spare capacity must last before a job grows."
    )
    grow_warm_wait_s: float = Field(
        default=60.0,
        ge=0,
        description="How long a running job trains on, rather than stop to grow, while a new "
        "node's warm worker processes are still starting (0: grow at once and wait for them).",
    )
    below_min_timeout_s: float = Field(
        default=600.0, gt=0, description="How long a job may wait below min_workers before failing."
    )
    restart_backoff_s: float = Field(default=1.0, ge=0)
    queue_reserve_after_s: float = Field(
        default=300.0,
        ge=0,
        description="A job queued this long holds a reservation: capacity it could use goes "
        "to nobody else until it starts (no job waits forever behind others' smaller ones).",
    )
    ray_namespace: str = "elastrain"
    ray_num_cpus: int | None = Field(
        default=None, description="CPUs of the local Ray (unset: all)."
    )
    warm_workers_per_node: int = Field(
        default=2,
        ge=0,
        description="Idle worker processes (torch imported) kept on every node ahead of need.",
    )
    preemption_notice: str | None = Field(
        default=None,
        description="What every node watches for a cloud's preemption notice: a file path or "
        "an http(s) URL (e.g. AWS's spot/instance-action metadata URL). A notice drains the "
        "node through Ray's drain API, and jobs leave it (workers/runtime/notice.py). Unset: "
        "not watched (drains from Ray's autoscaler or KubeRay are seen either way).",
    )
    collective_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="How long a rank waits in a collective (or for its peers to rendezvous) "
        "before it gives up; a dead peer is noticed at once, a partitioned one after this.",
    )

    # --- experiment trackers (service/tracking/destinations.py) -----------------------
    mlflow_tracking_uri: str | None = Field(
        default=None,
        description="The operator's MLflow tracker: jobs whose tracking.mlflow names no URI "
        "forward there, and only there go the MLFLOW_TRACKING_TOKEN/USERNAME/PASSWORD of "
        "the service's environment. Any scheme MLflow reads (the operator chose it).",
    )
    tracking_allowed_uris: Annotated[list[str], NoDecode] = Field(
        default=[],
        description="Other MLflow servers jobs may name (comma-separated http(s)://host[:port]); "
        "they are called without the operator's credentials. File paths, databases and "
        "unlisted hosts (internal addresses among them) are refused at submit.",
    )

    tenant_users: Annotated[list[str], NoDecode] = Field(
        default=[],
        description="The OS identity each tenant's workload.command scripts run as, "
        "comma-separated tenant=uid[:gid] (numeric): the workers must be able to change user "
        "(root or CAP_SETUID), else such an attempt fails saying so. A tenant not listed "
        "may submit no command job while the map is set. Unset: scripts run as the workers.",
    )

    # --- bounds on what a job puts into shared state (README "Security") ------------
    export_max_concurrent: int = Field(
        default=2,
        ge=1,
        description="Exports running at once per API process, all tenants together (each "
        "holds two copies of a model's weights); past it a 429.",
    )
    export_max_per_tenant: int = Field(
        default=1, ge=1, description="Exports of one tenant running at once per API process."
    )
    max_queued_jobs_per_tenant: int = Field(
        default=1000,
        ge=1,
        description="PENDING jobs one tenant may have; a submit past it is a 429.",
    )
    metric_names_per_point: int = Field(
        default=64, ge=1, description="Metric names one step's point may carry; the rest dropped."
    )
    metric_point_bytes: int = Field(
        default=4096,
        ge=64,
        description="Bytes of names and values one point may hold (the extra names dropped).",
    )
    metric_points_per_s: float = Field(
        default=50.0,
        gt=0,
        description="Points a job may store per second, on average (a burst of 10 s of it); "
        "the rest dropped.",
    )
    metric_points_per_job: int = Field(
        default=500_000,
        ge=1,
        description="Points one job may store in all; later ones dropped (its summaries and "
        "the step counter go on).",
    )
    metric_bytes_per_response: int = Field(
        default=16 * 1024 * 1024,
        ge=64 * 1024,
        description="Bytes one `GET /v1/jobs/{id}/metrics` answers; past it the first rows "
        "that fit, and the next page's since_step in X-Elastrain-Truncated-Next-Since-Step.",
    )
    log_files_per_job: int = Field(
        default=256, ge=1, description="Log files of a job the API reads (the ranks' own first)."
    )
    log_bytes_per_response: int = Field(
        default=1024 * 1024,
        ge=4096,
        description="Bytes of log lines one `GET /v1/jobs/{id}/logs` answers; the rest is the "
        "next page (its `next_offset`).",
    )

    # --- trust (README "Security") ---------------------------------------------------
    api_token: SecretStr | None = Field(
        default=None,
        description="The operator's admin token. Setting it turns authentication on: every "
        "request but /healthz and the dashboard's static shell then needs "
        "'Authorization: Bearer <token>' (this one, or one made with `elastrain token create`).",
    )
    api_token_file: Path | None = Field(
        default=None,
        description="A file holding the admin token (as container secrets are mounted, "
        "e.g. /run/secrets/elastrain_token); instead of ELASTRAIN_API_TOKEN, not with it.",
    )
    auth: bool = Field(
        default=False,
        description="Require tokens even without ELASTRAIN_API_TOKEN (tokens from the database "
        "only; bootstrap the first with `elastrain token create --database-url ...`).",
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default=["localhost", "127.0.0.1", "::1"],
        description="Host headers the API answers (comma-separated; '*' for any). Refusing "
        "others stops DNS rebinding from reaching a loopback-bound service from a browser.",
    )
    allowed_entrypoints: Annotated[list[str], NoDecode] = Field(
        default=[],
        description="Module prefixes custom `workload.entrypoint`s may come from "
        "(comma-separated). The standard library is never allowed.",
    )
    max_package_bytes: int = Field(
        default=64 * 2**20,
        ge=1,
        description="Largest working-directory upload (the zip), bytes.",
    )
    max_package_unpacked_bytes: int = Field(
        default=256 * 2**20,
        ge=1,
        description="Largest working directory once unpacked, bytes (bounds a zip bomb).",
    )
    max_package_files: int = Field(
        default=10_000, ge=1, description="Most files in a working directory."
    )
    max_package_expansion: float = Field(
        default=100.0,
        ge=1,
        description="Most bytes a working-directory upload may unpack to per byte of the zip "
        "(beyond its first MiB): counted while unpacking, so a zip bomb stops at once.",
    )
    package_quota_bytes: int | None = Field(
        default=2**30,
        ge=1,
        description="What one tenant's uploaded packages may take on the storage, bytes "
        "(unpacked; unset: no quota).",
    )
    worker_memory_bytes: int | None = Field(
        default=None,
        ge=1,
        description="Memory one worker has, for `strategy.kind: auto` plans (a GPU's; unset: "
        "a CPU worker's share of its node's memory as Ray reports it).",
    )
    package_keep_days: float = Field(
        default=7.0,
        gt=0,
        description="An uploaded working directory that no unfinished job uses is deleted "
        "this long after the last job was submitted with it.",
    )
    metrics_thin_after_days: float | None = Field(
        default=None,
        gt=0,
        description="Thin the per-step metric rows of jobs finished this long ago to those "
        "their curve needs (about 4 in 64 steps: each bucket's lowest and highest loss, "
        "slowest step, held-out loss; unset: keep every row).",
    )
    default_max_workers_per_tenant: int | None = Field(
        default=None,
        ge=1,
        description="A tenant's quota of running workers unless `elastrain tenant set` gives "
        "it its own (unset: no quota).",
    )
    log_format: str = Field(
        default="text", pattern="^(text|json)$", description="text | json (one object a line)."
    )

    @field_validator("api_token")
    @classmethod
    def _token_not_empty(cls, value: SecretStr | None) -> SecretStr | None:
        # An empty ELASTRAIN_API_TOKEN used to mean "auth off": a typo in a secret's name
        # then opened the cluster. Now it is an error; unset the variable to turn auth off.
        if value is not None and len(value.get_secret_value().strip()) < MIN_TOKEN_LENGTH:
            raise ValueError(
                f"ELASTRAIN_API_TOKEN must be at least {MIN_TOKEN_LENGTH} characters "
                "(unset it to run without authentication, on loopback only)"
            )
        return value

    @model_validator(mode="after")
    def _token_from_file(self) -> Settings:
        if self.api_token_file is None:
            return self
        if self.api_token is not None:
            raise ValueError("give ELASTRAIN_API_TOKEN or ELASTRAIN_API_TOKEN_FILE, not both")
        try:
            token = self.api_token_file.read_text().strip()
        except OSError as exc:
            raise ValueError(
                f"ELASTRAIN_API_TOKEN_FILE: cannot read {self.api_token_file}: {exc.strerror}"
            ) from None
        self.api_token = self._token_not_empty(SecretStr(token))
        return self

    @field_validator(
        "allowed_hosts",
        "allowed_entrypoints",
        "tracking_allowed_uris",
        "tenant_users",
        mode="before",
    )
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("tenant_users")
    @classmethod
    def _identities(cls, value: list[str]) -> list[str]:
        parse_tenant_users(value)  # raises, naming the entry
        return value

    @property
    def tenant_identities(self) -> dict[str, RunAs]:
        return parse_tenant_users(self.tenant_users)

    @field_validator("tracking_allowed_uris")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        from elastrain.service.tracking.destinations import parse_allowed

        parse_allowed(value)  # raises, naming the entry
        return value

    @property
    def allowed_trackers(self) -> list[Any]:
        """`tracking_allowed_uris` as origins (`service.tracking.destinations.Origin`)."""
        from elastrain.service.tracking.destinations import parse_allowed

        return parse_allowed(self.tracking_allowed_uris)

    @field_validator("allowed_entrypoints")
    @classmethod
    def _no_stdlib(cls, value: list[str]) -> list[str]:
        for prefix in value:
            if in_standard_library(prefix):
                raise ValueError(
                    f"ELASTRAIN_ALLOWED_ENTRYPOINTS: {prefix!r} is in the standard library; "
                    "its functions run commands, never allow them as workloads"
                )
            if prefix.split(".")[0] in OWN_PACKAGES:
                raise ValueError(
                    f"ELASTRAIN_ALLOWED_ENTRYPOINTS: {prefix!r} is elastrain's own code; "
                    "the built-in workloads are reached by name (workload.name)"
                )
        return value

    @property
    def secrets(self) -> list[str]:
        """What must never reach a job's processes: the admin token, the database URL and
        its password (`elastrain.service.worker_env`)."""
        found = [self.database_url]
        if self.api_token is not None:
            found.append(self.api_token.get_secret_value())
        try:
            password = make_url(self.database_url).password
        except Exception:  # not a URL SQLAlchemy reads: the whole of it is hidden anyway
            password = None
        if password:
            found.append(str(password))
        return found

    @property
    def metric_limits(self) -> MetricLimits:
        return MetricLimits(
            names_per_point=self.metric_names_per_point,
            point_bytes=self.metric_point_bytes,
            points_per_s=self.metric_points_per_s,
            points_per_job=self.metric_points_per_job,
        )

    @property
    def single_user(self) -> bool:
        """Ray is local: jobs' code runs as this service's user, next to its files."""
        return self.ray_address is None

    @property
    def auth_enabled(self) -> bool:
        return self.auth or self.api_token is not None

    @property
    def package_limits(self) -> PackageLimits:
        return PackageLimits(
            max_archive_bytes=self.max_package_bytes,
            max_unpacked_bytes=self.max_package_unpacked_bytes,
            max_files=self.max_package_files,
            max_expansion=self.max_package_expansion,
        )

    @field_validator("storage_path")
    @classmethod
    def _absolute_storage(cls, value: Path) -> Path:
        # Ray's actors and worker processes run with other working directories: a relative
        # path would name another folder there. Resolve once, here.
        return value.expanduser().resolve()

    def ensure_dirs(self) -> None:
        """Create what does not exist yet readable by this user only: the storage root
        (0700) and the SQLite file (0600, its folder 0700). What exists is left as the
        operator made it (an external cluster's workers may need a group's access)."""
        private_dirs(self.storage_path)
        if self.database_url.startswith("sqlite:///"):
            db_file = Path(self.database_url.removeprefix("sqlite:///"))
            private_dirs(db_file.parent)
            if not db_file.exists():
                db_file.touch(mode=0o600)


def private_dirs(path: Path) -> None:
    """`mkdir -p` where every folder made is 0700."""
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for folder in reversed(missing):
        folder.mkdir(mode=0o700, exist_ok=True)
        folder.chmod(0o700)  # mkdir's mode is filtered by the umask; this is not
