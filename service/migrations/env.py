"""Alembic environment: runs on the connection `elastrain.service.db.migrate` hands over."""

from alembic import context

from elastrain.service.models import Base

config = context.config
connection = config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
