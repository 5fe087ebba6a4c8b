"""benchmarks

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-22 10:59:30.884887
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "benchmarks",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("endpoint_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=True),
        sa.Column("model", sqlmodel.sql.sqltypes.AutoString(length=160), nullable=False),
        sa.Column("pool", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("runtime", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("chips", sa.Integer(), nullable=False),
        sa.Column("price_per_chip_hour", sa.Float(), nullable=False),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("results", sa.JSON(), nullable=False),
        sa.Column("requests_done", sa.Integer(), nullable=False),
        sa.Column("requests_total", sa.Integer(), nullable=False),
        sa.Column("error", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("started_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("finished_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("updated_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(["endpoint_id"], ["endpoints.id"], ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["owner_id"], ["users.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("benchmarks", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_benchmarks_endpoint_id"), ["endpoint_id"], unique=False)
        batch_op.create_index("ix_benchmarks_owner_created", ["owner_id", "created_at", "id"], unique=False)
        batch_op.create_index(batch_op.f("ix_benchmarks_status"), ["status"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("benchmarks", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_benchmarks_status"))
        batch_op.drop_index("ix_benchmarks_owner_created")
        batch_op.drop_index(batch_op.f("ix_benchmarks_endpoint_id"))

    op.drop_table("benchmarks")
