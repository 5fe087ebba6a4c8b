"""evaluation judge: its sealed key, and its verdicts per sample

Revision ID: 0016
Revises: 0015
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("evaluations", sa.Column("judge_key", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
    with op.batch_alter_table("evaluation_samples") as batch:
        batch.add_column(sa.Column("judgements", sa.JSON(), nullable=False, server_default="{}"))


def downgrade() -> None:
    with op.batch_alter_table("evaluation_samples") as batch:
        batch.drop_column("judgements")
    op.drop_column("evaluations", "judge_key")
