"""Custom losses created over the Tinker HTTP door, per tenant, in the database: they survive a gateway restart
and every replica resolves them (they were kept in one process's memory before).

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "custom_losses",
        sa.Column("loss_id", sa.String(128), primary_key=True),
        sa.Column("tenant", sa.String(256), nullable=False),
        sa.Column("loss", sa.LargeBinary, nullable=False),
        sa.Column("created", sa.Float, nullable=False),
    )
    op.create_index("ix_custom_losses_tenant_created", "custom_losses", ["tenant", "created"])


def downgrade() -> None:
    op.drop_index("ix_custom_losses_tenant_created", "custom_losses")
    op.drop_table("custom_losses")
