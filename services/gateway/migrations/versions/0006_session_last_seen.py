"""When a session was last heard from (a heartbeat or any request naming it), so that a gateway can finish sessions
idle longer than its ``--session-idle-s``: the official SDK never finishes its sessions. NULL: not heard from since it
was created (its ``created_at`` stands in).

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as t:
        t.add_column(sa.Column("last_seen", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sessions") as t:
        t.drop_column("last_seen")
