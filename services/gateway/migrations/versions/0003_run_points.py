"""The console's curves: one row per finished training step of a run, with its metrics.

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
    op.create_table(
        "run_points",
        sa.Column("model_id", sa.String(128), nullable=False),
        sa.Column("tenant", sa.String(256), nullable=False),
        sa.Column("seq_id", sa.BigInteger, nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("op", sa.String(32), nullable=False),
        sa.Column("metrics", sa.Text, nullable=False),
        sa.Column("finished", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("model_id", "seq_id", "op"),
    )


def downgrade() -> None:
    op.drop_table("run_points")
