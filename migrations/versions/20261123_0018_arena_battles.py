"""arena battles: two endpoints' answers to one prompt, and the vote between them

Revision ID: 0018
Revises: 0017
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "arena_battles",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.Column("dataset_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=True),
        sa.Column("position", sa.Integer(), nullable=True),
        sa.Column("sides", sa.JSON(), nullable=False),
        sa.Column("outputs", sa.JSON(), nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        sa.Column("vote", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("voted_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.ForeignKeyConstraint(["dataset_id"], ["datasets.id"], ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["owner_id"], ["users.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("arena_battles", schema=None) as batch_op:
        batch_op.create_index("ix_arena_battles_owner_created", ["owner_id", "created_at", "id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("arena_battles", schema=None) as batch_op:
        batch_op.drop_index("ix_arena_battles_owner_created")

    op.drop_table("arena_battles")
