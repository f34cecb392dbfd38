"""jobs.log: a failed job's full log (its one-line `error` says what failed and what to do next);
jobs.trials_reused: how many measured trials the job found in its study when it started

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 11:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("log", sa.Text(), nullable=True))
        batch.add_column(sa.Column("trials_reused", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("trials_reused")
        batch.drop_column("log")
