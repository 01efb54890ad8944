"""A PostgreSQL database of its own for a bench run, dropped afterwards."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa


@contextmanager
def scratch_database(admin_url: str, prefix: str) -> Iterator[str]:
    """Create `<prefix>_<pid>` through `admin_url` (a database on the server to connect
    to for CREATE/DROP) and yield its URL; drop it on the way out, whatever happened."""
    name = f"{prefix}_{os.getpid()}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
