"""Session listing and sampling-session clients: when each session was created (listed newest first) and how
many clients joined each sampling session (``join_sampling_session`` numbers them).

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
    with op.batch_alter_table("sessions") as t:
        t.add_column(sa.Column("created_at", sa.Float, nullable=False, server_default="0"))
    op.create_index("ix_sessions_tenant_created", "sessions", ["tenant", "created_at"])
    with op.batch_alter_table("sampling_sessions") as t:
        t.add_column(sa.Column("clients", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("sampling_sessions") as t:
        t.drop_column("clients")
    op.drop_index("ix_sessions_tenant_created", "sessions")
    with op.batch_alter_table("sessions") as t:
        t.drop_column("created_at")
