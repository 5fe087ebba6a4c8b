"""endpoint replaces: the endpoint whose model name a promoted one takes over once ready

Revision ID: 0017
Revises: 0016
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("endpoints") as batch:
        batch.add_column(sa.Column("replaces_id", sa.String(length=32), nullable=True))
        batch.create_foreign_key(
            "fk_endpoints_replaces_id_endpoints", "endpoints", ["replaces_id"], ["id"], ondelete="SET NULL"
        )


def downgrade() -> None:
    with op.batch_alter_table("endpoints") as batch:
        batch.drop_constraint("fk_endpoints_replaces_id_endpoints", type_="foreignkey")
        batch.drop_column("replaces_id")
