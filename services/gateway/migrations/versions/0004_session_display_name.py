"""A session's display name (Tinker's ``ServiceClient(display_name=...)``), which session search matches and
``get_session`` answers. NULL for sessions recorded before this revision and for sessions created without one.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as t:
        t.add_column(sa.Column("display_name", sa.String(256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sessions") as t:
        t.drop_column("display_name")
