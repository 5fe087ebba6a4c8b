"""endpoints

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22 08:51:49.361299
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "endpoints",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("artifact_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("model", sqlmodel.sql.sqltypes.AutoString(length=160), nullable=False),
        sa.Column("pool", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("runtime", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("phase", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=True),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("url", sqlmodel.sql.sqltypes.AutoString(length=255), nullable=True),
        sa.Column("worker", sqlmodel.sql.sqltypes.AutoString(length=255), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("heartbeat_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("error", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("started_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("ready_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("stopped_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("updated_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(["artifact_id"], ["artifacts.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["owner_id"], ["users.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("endpoints", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_endpoints_artifact_id"), ["artifact_id"], unique=False)
        batch_op.create_index("ix_endpoints_owner_created", ["owner_id", "created_at", "id"], unique=False)
        batch_op.create_index(batch_op.f("ix_endpoints_status"), ["status"], unique=False)

    op.create_table(
        "endpoint_samples",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("endpoint_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("source", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("duration_s", sa.Float(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("error", sqlmodel.sql.sqltypes.AutoString(length=500), nullable=True),
        sa.Column("server_ttft_s", sa.Float(), nullable=True),
        sa.Column("generation_tokens_per_s", sa.Float(), nullable=True),
        sa.Column("running", sa.Integer(), nullable=True),
        sa.Column("waiting", sa.Integer(), nullable=True),
        sa.Column("kv_cache_usage", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["endpoint_id"], ["endpoints.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("endpoint_samples", schema=None) as batch_op:
        batch_op.create_index("ix_endpoint_samples_endpoint_at", ["endpoint_id", "at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("endpoint_samples", schema=None) as batch_op:
        batch_op.drop_index("ix_endpoint_samples_endpoint_at")

    op.drop_table("endpoint_samples")
    with op.batch_alter_table("endpoints", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_endpoints_status"))
        batch_op.drop_index("ix_endpoints_owner_created")
        batch_op.drop_index(batch_op.f("ix_endpoints_artifact_id"))

    op.drop_table("endpoints")
