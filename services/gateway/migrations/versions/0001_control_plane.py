"""The control plane's schema: sessions, training runs, sampling sessions, inflight targets, sequence records, custom
losses, run points and the operations ledger (``lathe.gateway.store`` reads and writes them;
``lathe.gateway.store_tables.metadata`` is this schema, checked by a test).

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
        sa.Column("follows", sa.String(128), nullable=False, server_default=""),
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
    op.create_table(
        "inflight_targets",
        sa.Column("model_id", sa.String(128), primary_key=True),
        sa.Column("tenant", sa.String(256), nullable=False),
        sa.Column("model_path", sa.Text, nullable=False),
        sa.Column("version", sa.Float, nullable=False),
    )
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
    for table in ("run_points", "sequence_records", "inflight_targets", "operations", "custom_losses",
                  "sampling_sessions", "runs", "sessions"):
        op.drop_table(table)
