"""nightly_results: the best's interval (the next night's verdict allows for the noise of both
nights), the recipe's hash (a night is compared only with nights of the same recipe), and the night
it was compared with and the fingerprint changes between the two (the dashboard shows what the
report said)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05 09:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nightly_results") as batch:
        batch.add_column(sa.Column("best_ci", sa.Float(), nullable=True))
        batch.add_column(sa.Column("recipe_hash", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("compared_night", sa.Date(), nullable=True))
        batch.add_column(sa.Column("fingerprint_changes", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nightly_results") as batch:
        batch.drop_column("fingerprint_changes")
        batch.drop_column("compared_night")
        batch.drop_column("recipe_hash")
        batch.drop_column("best_ci")
