"""pool slices: hosts per slice of a pool, and each worker's slice and place in it

Revision ID: 0020
Revises: 0019
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("pools") as batch:
        batch.add_column(sa.Column("hosts_per_slice", sa.Integer(), nullable=False, server_default="1"))
    with op.batch_alter_table("worker_hosts") as batch:
        batch.add_column(sa.Column("slice", sa.String(length=128), nullable=True))
        batch.add_column(sa.Column("host_index", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("worker_hosts") as batch:
        batch.drop_column("host_index")
        batch.drop_column("slice")
    with op.batch_alter_table("pools") as batch:
        batch.drop_column("hosts_per_slice")
