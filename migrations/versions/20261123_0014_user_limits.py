"""user limits: max_live_endpoints and max_active_runs on users (null: the settings' defaults)

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-24 10:05:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.add_column(sa.Column("max_live_endpoints", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("max_active_runs", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.drop_column("max_active_runs")
        batch_op.drop_column("max_live_endpoints")
