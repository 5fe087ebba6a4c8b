"""benchmark heartbeats and cancel

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-23 09:12:40.318207
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("benchmarks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("worker", sqlmodel.sql.sqltypes.AutoString(length=255), nullable=True))
        batch_op.add_column(sa.Column("heartbeat_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True))
        batch_op.add_column(sa.Column("cancel_requested", sa.Boolean(), nullable=False, server_default=sa.false()))
    # Benchmarks left running by workers that never beat: the stale sweep fails them after one silence.
    op.execute("UPDATE benchmarks SET heartbeat_at = updated_at WHERE status = 'running'")


def downgrade() -> None:
    with op.batch_alter_table("benchmarks", schema=None) as batch_op:
        batch_op.drop_column("cancel_requested")
        batch_op.drop_column("heartbeat_at")
        batch_op.drop_column("worker")
