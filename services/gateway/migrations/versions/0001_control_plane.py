"""The control plane: sessions, training runs, sampling sessions, custom losses and the operations ledger
(``lathe.gateway.store`` reads and writes them; its ``metadata`` is this schema, checked by a test).

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("session_id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(256), nullable=False),
        sa.Column("user_metadata", sa.Text, nullable=False),
        sa.Column("next_model", sa.Integer, nullable=False),
        sa.Column("next_sampler", sa.Integer, nullable=False),
        sa.Column("finished", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False, server_default="0"),
        sa.Column("display_name", sa.String(256), nullable=True),
        sa.Column("last_seen", sa.Float, nullable=True),
    )
    op.create_index("ix_sessions_tenant_created", "sessions", ["tenant", "created_at"])
    op.create_table(
        "runs",
        sa.Column("model_id", sa.String(128), primary_key=True),
        sa.Column("tenant", sa.String(256), nullable=False),
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("base_model", sa.String(256), nullable=False),
        sa.Column("lora", sa.LargeBinary, nullable=False),
        sa.Column("user_metadata", sa.Text, nullable=False),
        sa.Column("create_request_id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("last_request_time", sa.Float, nullable=False),
        sa.Column("last_checkpoint", sa.Text, nullable=False),
        sa.Column("last_checkpoint_time", sa.Float, nullable=False),
        sa.Column("last_sampler_checkpoint", sa.Text, nullable=False),
        sa.Column("last_sampler_checkpoint_time", sa.Float, nullable=False),
        sa.Column("recovery_seq", sa.BigInteger, nullable=False),
        sa.Column("optimizer", sa.String(16), nullable=True),
    )
    op.create_index("ix_runs_tenant", "runs", ["tenant"])
    op.create_table(
        "sampling_sessions",
        sa.Column("sampling_session_id", sa.String(128), primary_key=True),
        sa.Column("tenant", sa.String(256), nullable=False),
        sa.Column("base_model", sa.String(256), nullable=False),
        sa.Column("model_path", sa.Text, nullable=False),
        sa.Column("version", sa.Float, nullable=False),
        sa.Column("clients", sa.Integer, nullable=False, server_default="0"),
    )
    op.create_table(
        "custom_losses",
        sa.Column("loss_id", sa.String(128), primary_key=True),
        sa.Column("tenant", sa.String(256), nullable=False),
        sa.Column("loss", sa.LargeBinary, nullable=False),
        sa.Column("created", sa.Float, nullable=False),
    )
    op.create_index("ix_custom_losses_tenant_created", "custom_losses", ["tenant", "created"])
    op.create_table(
        "operations",
        sa.Column("request_id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(256), nullable=False),
        sa.Column("key", sa.String(128), nullable=False),
        sa.Column("seq_id", sa.BigInteger, nullable=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("request", sa.LargeBinary, nullable=False),
        sa.Column("sampling_seq_id", sa.BigInteger, nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("result", sa.LargeBinary, nullable=True),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("finished", sa.Float, nullable=True),
        sa.UniqueConstraint("key", "seq_id", name="uq_operations_key_seq"),
    )
    op.create_index("ix_operations_state_finished", "operations", ["state", "finished"])


def downgrade() -> None:
    for table in ("operations", "custom_losses", "sampling_sessions", "runs", "sessions"):
        op.drop_table(table)
