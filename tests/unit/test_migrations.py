"""The Alembic migrations build exactly the schema `service/models.py` describes."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect

from elastrain.service.db import alembic_config, make_engine, migrate
from elastrain.service.models import Base


def _diff(engine: Engine) -> list[object]:
    with engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn, opts={"compare_type": True, "compare_server_default": True}
        )
        return list(compare_metadata(ctx, Base.metadata))


def test_migrated_schema_matches_models(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        migrate(engine)
        assert _diff(engine) == [], "models changed without a migration: add a revision"
        assert set(inspect(engine).get_table_names()) >= set(Base.metadata.tables)
    finally:
        engine.dispose()


def test_migrate_is_idempotent_and_at_head(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        migrate(engine)
        migrate(engine)  # a restart of `elastrain serve` on an up-to-date database
        head = ScriptDirectory.from_config(alembic_config(engine)).get_current_head()
        with engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() == head
    finally:
        engine.dispose()


def test_downgrade_to_base_and_back(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        migrate(engine)
        with engine.begin() as conn:
            cfg = alembic_config(engine)
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "base")
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        migrate(engine)
        assert _diff(engine) == []
    finally:
        engine.dispose()


def test_metric_summaries_are_built_for_jobs_stored_before(db_url: str) -> None:
    """0005 backfills the bucket summaries from the rows a database already holds."""
    import json

    from sqlalchemy import text

    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            cfg = alembic_config(engine)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0004")
            conn.execute(
                text(
                    "INSERT INTO jobs (id, owner, name, spec, state, priority, strategy, "
                    "min_workers, max_workers, max_steps, step, attempt, restarts, world_size, "
                    "cancel_requested, checkpoint_requested, created_at, updated_at, seconds_in, "
                    "compute_s, kept_s, stall_s) VALUES (1, 'anyone', 'old', :spec, 'SUCCEEDED', "
                    "0, 'ddp', 1, 1, 100, 100, 1, 0, 1, false, false, :now, :now, '{}', 0, 0, 0)"
                ),
                {"spec": json.dumps({"name": "old"}), "now": "2026-01-01T00:00:00+00:00"},
            )
            loss = {s: 5.0 - s / 100 for s in range(1, 101)}
            loss[37] = 9.0
            conn.execute(
                text(
                    'INSERT INTO metrics (job_id, step, attempt, at, "values") '
                    "VALUES (1, :step, 1, :at, :values)"
                ),
                [
                    {
                        "step": s,
                        "at": "2026-01-01T00:00:00+00:00",
                        "values": json.dumps({"loss": v}),
                    }
                    for s, v in loss.items()
                ],
            )
            command.upgrade(cfg, "head")
            rows = conn.execute(
                text("SELECT hi_step, lo_step FROM metric_buckets WHERE job_id = 1 AND width = 512")
            ).all()
        assert rows == [(37, 100)]
    finally:
        engine.dispose()


def test_packages_jobs_used_before_0008_stay_their_owners(db_url: str) -> None:
    """0008 grants each package a stored job names to that job's owner (and nobody else)."""
    import json

    from sqlalchemy import text

    digest = "sha256:" + "e" * 64
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            cfg = alembic_config(engine)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0007")
            for job_id, owner, workload in (
                (1, "team-a", {"entrypoint": "m:build", "package": digest}),
                (2, "team-a", {"entrypoint": "m:build", "package": digest}),
                (3, "team-b", {"name": "synthetic"}),
            ):
                conn.execute(
                    text(
                        "INSERT INTO jobs (id, owner, name, spec, state, priority, strategy, "
                        "min_workers, max_workers, max_steps, step, attempt, restarts, "
                        "world_size, cancel_requested, checkpoint_requested, created_at, "
                        "updated_at, seconds_in, compute_s, kept_s, stall_s) VALUES (:id, "
                        ":owner, 'old', :spec, 'SUCCEEDED', 0, 'ddp', 1, 1, 100, 100, 1, 0, 1, "
                        "false, false, :now, :now, '{}', 0, 0, 0)"
                    ),
                    {
                        "id": job_id,
                        "owner": owner,
                        "spec": json.dumps({"name": "old", "workload": workload}),
                        "now": "2026-01-01T00:00:00+00:00",
                    },
                )
            command.upgrade(cfg, "head")
            rows = conn.execute(text("SELECT digest, tenant, uploaded FROM package_owners")).all()
        assert [tuple(r) for r in rows] == [(digest, "team-a", True)]
    finally:
        engine.dispose()
