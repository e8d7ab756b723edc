"""Inflight sampling: each run's published inflight weights, and the run an inflight sampling session follows.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "inflight_targets",
        sa.Column("model_id", sa.String(128), primary_key=True),
        sa.Column("tenant", sa.String(256), nullable=False),
        sa.Column("model_path", sa.Text, nullable=False),
        sa.Column("version", sa.Float, nullable=False),
    )
    with op.batch_alter_table("sampling_sessions") as batch:
        batch.add_column(sa.Column("follows", sa.String(128), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("sampling_sessions") as batch:
        batch.drop_column("follows")
    op.drop_table("inflight_targets")
