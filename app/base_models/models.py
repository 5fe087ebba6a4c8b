from datetime import datetime

from sqlmodel import Field, SQLModel

from app.core.db import utcnow
from app.core.schemas import NAME_LENGTH, Schema

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"


class RegisteredModel(SQLModel, table=True):
    """A base model in Hugging Face layout at a source an admin registered: a local directory or an
    fsspec URL (``gs://bucket/prefix``). Its architecture is its preset's (checked against its
    config.json when registered, and again by the worker before it trains)."""

    __tablename__ = "base_models"  # pyright: ignore[reportAssignmentType]
    name: str = Field(primary_key=True, max_length=64)
    preset: str = Field(max_length=64)
    source: str = Field(max_length=1024)
    description: str = Field(default="", max_length=500)
    created_by: int | None = Field(default=None, foreign_key="users.id", ondelete="SET NULL")
    created_at: datetime = Field(default_factory=utcnow)


class RegisteredModelCreate(Schema):
    name: str = Field(max_length=NAME_LENGTH, schema_extra={"pattern": NAME_PATTERN})
    preset: str = Field(max_length=NAME_LENGTH)
    source: str = Field(min_length=1, max_length=1024, description="an absolute directory or a URL like gs://b/p")
    description: str = Field(default="", max_length=500)


class BaseModelPublic(SQLModel):
    name: str
    preset: str
    source: str
    description: str
    builtin: bool
    params: int
    created_at: datetime | None = None


class BaseModelsPublic(SQLModel):
    data: list[BaseModelPublic]
    count: int
