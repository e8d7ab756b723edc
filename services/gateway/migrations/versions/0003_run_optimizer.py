"""A run's optimizer family ("adamw" | "dimuon"), so that a run rebuilt on a restarted trainer keeps it and its
info reports it. NULL for runs recorded before this revision: they were created with AdamW, the only family
then.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as t:
        t.add_column(sa.Column("optimizer", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as t:
        t.drop_column("optimizer")
