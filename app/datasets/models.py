from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, Index
from sqlmodel import AutoString, Field, SQLModel

from app.core.db import utcnow

FILENAME_LENGTH = 255


class DatasetStatus(StrEnum):
    validating = "validating"
    ready = "ready"
    invalid = "invalid"


class DatasetBase(SQLModel):
    filename: str = Field(max_length=FILENAME_LENGTH)
    purpose: str = Field(default="fine-tune", max_length=32)
    file_type: str | None = Field(default=None, max_length=16)
    format: str | None = Field(default=None, max_length=32)


class Dataset(DatasetBase, table=True):
    __tablename__ = "datasets"  # pyright: ignore[reportAssignmentType]
    # Lists are per owner, newest first: this index serves them without a sort.
    __table_args__ = (Index("ix_datasets_owner_created", "owner_id", "created_at", "id"),)
    id: str = Field(primary_key=True, max_length=32)
    owner_id: int = Field(foreign_key="users.id", ondelete="CASCADE")
    bytes: int = Field(sa_type=BigInteger)
    sha256: str = Field(max_length=64)
    storage_key: str = Field(max_length=512)
    requested_file_type: str | None = Field(default=None, max_length=16)
    requested_format: str | None = Field(default=None, max_length=32)
    status: DatasetStatus = Field(default=DatasetStatus.validating, index=True, sa_type=AutoString(16))
    progress_bytes: int = Field(default=0, sa_type=BigInteger)
    attempts: int = 0  # deliveries of its validation task that took it (``claim``): a few, then it gives up
    rows: int | None = None
    valid_rows: int | None = None
    error_count: int = 0
    duplicate_count: int = 0
    errors: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    duplicates: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    stats: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    preview: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    validated_at: datetime | None = None


class DatasetSummary(DatasetBase):
    """What lists show: no errors, stats or preview."""

    id: str
    bytes: int = Field(sa_type=BigInteger)
    sha256: str
    status: DatasetStatus
    progress_bytes: int
    rows: int | None
    valid_rows: int | None
    error_count: int
    duplicate_count: int
    created_at: datetime
    validated_at: datetime | None


class DatasetPublic(DatasetSummary):
    errors: list[dict[str, Any]]
    duplicates: list[dict[str, Any]]
    stats: dict[str, Any]
    preview: list[dict[str, Any]]


class DatasetsPublic(SQLModel):
    data: list[DatasetSummary]
    count: int


class OpenAIFile(SQLModel):
    """The `file` object of OpenAI's Files API."""

    id: str
    object: str = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    status_details: str | None = None
    expires_at: int | None = None


class OpenAIFileList(SQLModel):
    object: str = "list"
    data: list[OpenAIFile]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class OpenAIFileDeleted(SQLModel):
    id: str
    object: str = "file"
    deleted: bool
