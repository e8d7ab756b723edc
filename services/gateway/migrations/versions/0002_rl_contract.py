"""Tinker 0.38's RL contract: each run's published inflight weights, the run an inflight sampling session follows,
and the recorded sampled sequences (``record_stability_info``) that training datums' provenance spans resolve to.

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
    op.create_table(
        "sequence_records",
        sa.Column("sequence_id", sa.String(160), primary_key=True),
        sa.Column("tenant", sa.String(256), nullable=False),
        sa.Column("prompt", sa.LargeBinary, nullable=False),
        sa.Column("tokens", sa.LargeBinary, nullable=False),
        sa.Column("logprobs", sa.LargeBinary, nullable=False),
        sa.Column("policy", sa.Text, nullable=False),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("expires", sa.Float, nullable=False),
    )
    op.create_index("ix_sequence_records_tenant_created", "sequence_records", ["tenant", "created"])
    op.create_index("ix_sequence_records_expires", "sequence_records", ["expires"])


def downgrade() -> None:
    op.drop_table("sequence_records")
    with op.batch_alter_table("sampling_sessions") as batch:
        batch.drop_column("follows")
    op.drop_table("inflight_targets")
