"""Which database this is: the random id its schema was made with (migration 0006), and the
runtime's control key (`elastrain.contracts.capability`), made on first use."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from elastrain.contracts.capability import control_token, new_control_key
from elastrain.service.models import DatabaseIdentity

#: The `database_identity` row holding the runtime's control key (hex; 64 characters fit).
CONTROL_KEY_ROW = "runtime_control_key"


def database_id(session: Session) -> str:
    value = session.scalar(
        select(DatabaseIdentity.value).where(DatabaseIdentity.name == "database")
    )
    if value is None:
        raise RuntimeError(
            "the database has no identity: run the migrations (elastrain serve does)"
        )
    return value


def runtime_control_key(sessions: sessionmaker[Session]) -> bytes:
    """The key the runtime actor is created with and checks every call against. Kept in the
    database, which only the control plane reads (never the workers): it survives a control
    plane restart, goes with a restored backup (whose attempts are the same attempts), and a
    fresh database makes a new one (its control plane then replaces the runtime). Made on
    first use; of two control planes making it at once, the first one's insert wins."""
    for _ in range(2):
        with sessions() as session:
            value = session.scalar(
                select(DatabaseIdentity.value).where(DatabaseIdentity.name == CONTROL_KEY_ROW)
            )
            if value is not None:
                return bytes.fromhex(value)
            session.add(DatabaseIdentity(name=CONTROL_KEY_ROW, value=new_control_key().hex()))
            try:
                session.commit()
            except IntegrityError:  # another made it meanwhile: read theirs
                session.rollback()
                continue
    raise RuntimeError("cannot read or make the runtime's control key")


def runtime_control_token(sessions: sessionmaker[Session]) -> str:
    """What the control plane presents on its calls to the runtime (for tests, benches and
    an operator's debugging: `runtime.workers.remote(token)`)."""
    return control_token(runtime_control_key(sessions))
