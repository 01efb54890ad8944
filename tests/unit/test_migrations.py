"""The Alembic migrations build exactly the schema `service/models.py` describes."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect

from service.db import alembic_config, make_engine, migrate
from service.models import Base


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
