from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, Index
from sqlmodel import AutoString, Field, SQLModel

from app.core.db import utcnow
from app.core.schemas import ID_LENGTH, INT32_MAX, Schema


class ArtifactKind(StrEnum):
    merged = "merged"  # the base with the LoRA merged in: a Hugging Face checkpoint
    adapter = "adapter"  # the LoRA alone, as a PEFT adapter


class ArtifactStatus(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"


ACTIVE = {ArtifactStatus.queued, ArtifactStatus.running}


class Artifact(SQLModel, table=True):
    __tablename__ = "artifacts"  # pyright: ignore[reportAssignmentType]
    __table_args__ = (Index("ix_artifacts_owner_created", "owner_id", "created_at", "id"),)
    id: str = Field(primary_key=True, max_length=32)
    owner_id: int = Field(foreign_key="users.id", ondelete="CASCADE")
    run_id: str = Field(foreign_key="runs.id", ondelete="CASCADE", index=True, max_length=32)
    kind: ArtifactKind = Field(sa_type=AutoString(16))
    status: ArtifactStatus = Field(default=ArtifactStatus.queued, index=True, sa_type=AutoString(16))
    checkpoint_step: int
    name: str = Field(max_length=160, description="the model id: a run's fine_tuned_model for its merged artifact")
    path: str = Field(default="", max_length=1024)
    files: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    bytes_done: int = Field(default=0, sa_type=BigInteger)  # a 31B merge writes 57 GiB
    bytes_total: int = Field(default=0, sa_type=BigInteger)
    verification: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    error: str | None = None
    attempts: int = 0
    worker: str | None = Field(default=None, max_length=255)  # the host building it, while it is running
    heartbeat_at: datetime | None = None  # the build's supervisor beats; a silent one is re-queued
    waiting: str | None = Field(default=None, max_length=500)  # queued: what it waits for (a host's chips)
    created_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    updated_at: datetime = Field(default_factory=utcnow)


class ArtifactCreate(Schema):
    run_id: str = Field(max_length=ID_LENGTH)
    kind: ArtifactKind = ArtifactKind.merged
    checkpoint_step: int | None = Field(
        default=None, ge=1, le=INT32_MAX, description="default: the run's latest checkpoint"
    )


class ArtifactFile(SQLModel):
    path: str
    size: int
    sha256: str


class ArtifactPublic(SQLModel):
    id: str
    kind: ArtifactKind
    status: ArtifactStatus
    run_id: str
    checkpoint_step: int
    name: str
    path: str
    files: list[ArtifactFile]
    size_bytes: int
    bytes_done: int
    bytes_total: int
    verification: dict[str, Any] | None
    error: str | None
    attempts: int
    waiting: str | None = None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class ArtifactsPublic(SQLModel):
    data: list[ArtifactPublic]
    count: int
