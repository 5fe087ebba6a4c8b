"""runs

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 03:10:07.415769
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("base_model", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("dataset_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("validation_dataset_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=True),
        sa.Column("pool", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("suffix", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=24), nullable=False),
        sa.Column("phase", sqlmodel.sql.sqltypes.AutoString(length=24), nullable=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=True),
        sa.Column("error", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker", sqlmodel.sql.sqltypes.AutoString(length=255), nullable=True),
        sa.Column("heartbeat_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("stop_requested", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True),
        sa.Column("fine_tuned_model", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("started_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("finished_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("updated_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(["dataset_id"], ["datasets.id"], ondelete="RESTRICT"),
        sa.ForeignKeyConstraint(["owner_id"], ["users.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(
            ["pool"],
            ["pools.name"],
        ),
        sa.ForeignKeyConstraint(["validation_dataset_id"], ["datasets.id"], ondelete="RESTRICT"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_runs_dataset_id"), ["dataset_id"], unique=False)
        batch_op.create_index("ix_runs_owner_created", ["owner_id", "created_at", "id"], unique=False)
        batch_op.create_index(batch_op.f("ix_runs_status"), ["status"], unique=False)
        batch_op.create_index(batch_op.f("ix_runs_validation_dataset_id"), ["validation_dataset_id"], unique=False)

    op.create_table(
        "run_checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sqlmodel.sql.sqltypes.AutoString(length=1024), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("run_checkpoints", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_run_checkpoints_run_id"), ["run_id"], unique=False)

    op.create_table(
        "run_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("level", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=False),
        sa.Column("message", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("run_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_run_events_run_id"), ["run_id"], unique=False)

    op.create_table(
        "run_metrics",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("values", sa.JSON(), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("run_metrics", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_run_metrics_run_id"), ["run_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("run_metrics", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_run_metrics_run_id"))

    op.drop_table("run_metrics")
    with op.batch_alter_table("run_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_run_events_run_id"))

    op.drop_table("run_events")
    with op.batch_alter_table("run_checkpoints", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_run_checkpoints_run_id"))

    op.drop_table("run_checkpoints")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runs_validation_dataset_id"))
        batch_op.drop_index(batch_op.f("ix_runs_status"))
        batch_op.drop_index("ix_runs_owner_created")
        batch_op.drop_index(batch_op.f("ix_runs_dataset_id"))

    op.drop_table("runs")
