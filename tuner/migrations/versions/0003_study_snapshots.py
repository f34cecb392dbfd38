"""study_snapshots: a study's finished trials as compact rows, so the dashboard reads one row
instead of every parameter and attribute row of a large study

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 14:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "study_snapshots",
        sa.Column("study_name", sa.String(length=512), nullable=False),
        sa.Column("trials", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("saved_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("study_name"),
    )


def downgrade() -> None:
    op.drop_table("study_snapshots")
