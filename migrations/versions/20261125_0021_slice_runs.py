"""slice runs: a pool's shared directory, a run's slice and coordinator, and its processes (one per host);
what a queued artifact or a pending endpoint waits for (a host's chips)

Revision ID: 0021
Revises: 0020
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("pools") as batch:
        batch.add_column(sa.Column("shared_dir", sqlmodel.sql.sqltypes.AutoString(length=1024), nullable=True))
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("slice", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True))
        batch.add_column(sa.Column("coordinator", sqlmodel.sql.sqltypes.AutoString(length=255), nullable=True))
    for table in ("artifacts", "endpoints"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("waiting", sqlmodel.sql.sqltypes.AutoString(length=500), nullable=True))
    op.create_table(
        "run_processes",
        sa.Column(
            "run_id",
            sqlmodel.sql.sqltypes.AutoString(length=32),
            sa.ForeignKey("runs.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("host_index", sa.Integer(), primary_key=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("worker", sqlmodel.sql.sqltypes.AutoString(length=255), nullable=False),
        sa.Column("state", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("step_time_s", sa.Float(), nullable=True),
        sa.Column("heartbeat_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("run_processes")
    for table in ("endpoints", "artifacts"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("waiting")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("coordinator")
        batch.drop_column("slice")
    with op.batch_alter_table("pools") as batch:
        batch.drop_column("shared_dir")
