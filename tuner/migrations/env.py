"""Alembic environment: runs on the connection handed in by `tuner.migrations.upgrade`."""

from alembic import context

from tuner.db import Base
from tuner.migrations import VERSION_TABLE

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
