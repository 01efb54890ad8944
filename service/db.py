"""Engine, sessions and schema migrations (Alembic, applied on `elastrain serve` start)."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

_MIGRATIONS = Path(__file__).parent / "migrations"


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        # check_same_thread: the API's threadpool and the scheduler thread share the engine.
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            # WAL: readers never block the writer; NORMAL sync is durable across app crashes.
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    if url.startswith("postgresql://"):
        # Use psycopg 3 (the one we depend on) for plain postgresql:// URLs.
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return create_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A transaction: commit on success, roll back on any exception."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def alembic_config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    cfg.attributes["connection_engine"] = engine
    return cfg


#: The PostgreSQL advisory lock key migrations hold (any constant unique to us).
_MIGRATION_LOCK = 0x656C6173  # "elas"


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest revision (idempotent). Several processes starting
    at once (API workers, replicas) take turns: the first migrates, the others find the
    schema at head."""
    with _migration_lock(engine), engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            # Held until this transaction ends, the upgrade's own statements included.
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
        cfg = alembic_config(engine)
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


@contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    """SQLite has no advisory locks: an exclusive lock on a file beside the database (none
    for an in-memory one, which only this process sees)."""
    path = engine.url.database if engine.dialect.name == "sqlite" else None
    if not path or path == ":memory:":
        yield
        return
    with open(f"{path}.migrate-lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
