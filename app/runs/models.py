from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import ValidationInfo, field_validator, model_validator
from sqlalchemy import JSON, Column, Index
from sqlmodel import AutoString, Field, SQLModel

from app.base_models.presets import HF_TARGET_MODULES
from app.core.db import utcnow
from app.core.echo import echo
from app.core.schemas import ID_LENGTH, INT32_MAX, NAME_LENGTH, Schema


class RunStatus(StrEnum):
    """OpenAI's fine-tuning job states, plus `paused`."""

    validating_files = "validating_files"
    queued = "queued"
    running = "running"
    paused = "paused"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


TERMINAL = {RunStatus.succeeded, RunStatus.failed, RunStatus.cancelled}
MAX_STEPS = 10_000_000
MODEL_ID_LENGTH = 128  # runs.fine_tuned_model: ft:BASE:SUFFIX:RUN_ID


class RunConfig(Schema):
    """Hyperparameters of a LoRA run. Declared and validated here once; the worker trusts them."""

    lora_rank: int = Field(default=16, ge=1, le=1024)
    lora_alpha: float = Field(default=32.0, gt=0, le=65536)
    lora_dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: list(HF_TARGET_MODULES), min_length=1, max_length=len(HF_TARGET_MODULES)
    )
    quantization: Literal["nf4", "int8"] | None = Field(default=None, description="QLoRA: quantize the base")
    learning_rate: float = Field(default=1e-3, gt=0, le=1)
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = Field(default=0, ge=0, le=MAX_STEPS)
    epochs: int | None = Field(default=None, ge=1, le=1000)
    max_steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    batch_size: int = Field(default=8, ge=1, le=65536, description="global batch size")
    grad_accum_steps: int = Field(default=1, ge=1, le=1024)
    max_seq_len: int = Field(default=256, ge=1, le=1_048_576)
    packing: bool = False
    assistant_only_loss: bool = True
    enable_thinking: bool = Field(
        default=False, description="render the data with the chat template's thinking switch on (Gemma 4: <|think|>)"
    )
    seed: int = Field(default=0, ge=0, le=INT32_MAX)
    validation_fraction: float = Field(default=0.1, ge=0, lt=1)
    eval_every_steps: int = Field(default=20, ge=1, le=MAX_STEPS)
    checkpoint_every_steps: int = Field(default=20, ge=1, le=MAX_STEPS)
    checkpoints_kept: int = Field(default=3, ge=1, le=100)
    eval_every_checkpoint: bool = Field(
        default=False,
        description="when the run succeeds, evaluate every checkpoint it kept and its base model (exact match, "
        "chrF) on its validation dataset, else its training dataset: the run page charts the score by step",
    )
    mesh_dp: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="replicas of the model (default 1): each holds the whole base weights over its fsdp x tp chips "
        "and trains on its share of the batch; a step then exchanges one buffer of LoRA gradients, where fsdp "
        "gathers weights and sums each gradient on its own. For a model whose weights fit fsdp x tp chips",
    )
    mesh_fsdp: int | None = Field(default=None, ge=1, le=4096, description="default: the pool's chips / (dp x tp)")
    mesh_tp: int | None = Field(default=None, ge=1, le=4096, description="default: 1")
    remat: Literal["none", "block", "decoder"] = "none"
    dtype: Literal["float32", "bfloat16"] = "float32"
    loss_chunk_tokens: int | None = Field(
        default=None,
        ge=0,
        le=1_048_576,
        description="compute the loss this many tokens at a time (0: never chunk; default: chunk by 1024 "
        "where one micro-batch's f32 logits per chip exceed 256 MiB)",
    )

    @field_validator("target_modules")
    @classmethod
    def _known_modules(cls, v: list[str]) -> list[str]:
        unknown = [m for m in v if m not in HF_TARGET_MODULES]
        if unknown:
            raise ValueError(f"unknown {echo(unknown)}; choose from {', '.join(HF_TARGET_MODULES)}")
        return v

    @field_validator("grad_accum_steps")
    @classmethod
    def _divides_batch(cls, v: int, info: ValidationInfo) -> int:
        batch = info.data.get("batch_size")
        if batch is not None and batch % v:
            raise ValueError(f"batch_size {batch} is not a multiple of grad_accum_steps {v}")
        return v

    @model_validator(mode="after")
    def _length(self):
        if self.epochs is None and self.max_steps is None:
            self.epochs = 1
        return self


class RunCreate(Schema):
    base_model: str = Field(default="tiny-gemma4", max_length=NAME_LENGTH)
    dataset_id: str = Field(max_length=ID_LENGTH)
    validation_dataset_id: str | None = Field(default=None, max_length=ID_LENGTH)
    pool: str = Field(default="cpu", max_length=NAME_LENGTH)
    suffix: str | None = Field(default=None, max_length=64)
    config: RunConfig = Field(default_factory=RunConfig)
    force: bool = Field(default=False, description="launch even if the estimate says it will not fit in memory")


class Run(SQLModel, table=True):
    __tablename__ = "runs"  # pyright: ignore[reportAssignmentType]
    __table_args__ = (Index("ix_runs_owner_created", "owner_id", "created_at", "id"),)
    id: str = Field(primary_key=True, max_length=32)
    owner_id: int = Field(foreign_key="users.id", ondelete="CASCADE")
    base_model: str = Field(max_length=64)
    # A dataset that a run uses cannot be deleted (RESTRICT): the API answers 409.
    dataset_id: str = Field(foreign_key="datasets.id", ondelete="RESTRICT", index=True, max_length=32)
    validation_dataset_id: str | None = Field(
        default=None, foreign_key="datasets.id", ondelete="RESTRICT", index=True, max_length=32
    )
    pool: str = Field(foreign_key="pools.name", max_length=64)
    suffix: str | None = Field(default=None, max_length=64)
    config: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    status: RunStatus = Field(default=RunStatus.queued, index=True, sa_type=AutoString(24))
    phase: str | None = Field(default=None, max_length=24)
    step: int = 0
    total_steps: int | None = None
    error: str | None = None
    attempts: int = 0
    lost_attempts: int = 0  # attempts whose worker went silent (killed or lost): a run gives up after a few
    worker: str | None = Field(default=None, max_length=255)
    heartbeat_at: datetime | None = None
    # On a multi-host slice pool: the slice whose hosts run it, and where they meet (host 0's address:port)
    slice: str | None = Field(default=None, max_length=128)
    coordinator: str | None = Field(default=None, max_length=255)
    stop_requested: str | None = Field(default=None, max_length=16, description="cancel | pause | handback")
    fine_tuned_model: str | None = Field(default=None, max_length=MODEL_ID_LENGTH)
    # The training file's records (by line) that training held out for validation (validation_fraction),
    # recorded when it loads its data: the eval set of an evaluation of this run's validation split.
    held_out_lines: list[int] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    created_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    updated_at: datetime = Field(default_factory=utcnow)


class RunProcess(SQLModel, table=True):
    """One host's process of a run on a multi-host slice (process 0 is the slice's host 0): its worker,
    its state and the step time it measures, so that a host that is slow or silent shows."""

    __tablename__ = "run_processes"  # pyright: ignore[reportAssignmentType]
    run_id: str = Field(foreign_key="runs.id", ondelete="CASCADE", primary_key=True, max_length=32)
    host_index: int = Field(primary_key=True)
    attempt: int
    worker: str = Field(max_length=255)
    state: str = Field(
        max_length=16, description="waiting (for its chips) | joining | training | done | stopped | failed"
    )
    step: int = 0
    step_time_s: float | None = None
    heartbeat_at: datetime = Field(default_factory=utcnow)


class RunEvent(SQLModel, table=True):
    __tablename__ = "run_events"  # pyright: ignore[reportAssignmentType]
    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="runs.id", ondelete="CASCADE", index=True, max_length=32)
    created_at: datetime = Field(default_factory=utcnow)
    level: str = Field(default="info", max_length=8)
    message: str


class RunMetric(SQLModel, table=True):
    __tablename__ = "run_metrics"  # pyright: ignore[reportAssignmentType]
    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="runs.id", ondelete="CASCADE", index=True, max_length=32)
    step: int
    values: dict[str, float] = Field(sa_column=Column(JSON, nullable=False))
    created_at: datetime = Field(default_factory=utcnow)


class RunCheckpoint(SQLModel, table=True):
    __tablename__ = "run_checkpoints"  # pyright: ignore[reportAssignmentType]
    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="runs.id", ondelete="CASCADE", index=True, max_length=32)
    step: int
    path: str = Field(max_length=1024)
    metrics: dict[str, float] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    created_at: datetime = Field(default_factory=utcnow)


class RunPublic(SQLModel):
    id: str
    base_model: str
    dataset_id: str
    validation_dataset_id: str | None
    pool: str
    suffix: str | None
    config: dict[str, Any]
    status: RunStatus
    phase: str | None
    step: int
    total_steps: int | None
    error: str | None
    attempts: int
    worker: str | None
    fine_tuned_model: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    cost_usd: float = 0.0
    slice: str | None = None  # on a multi-host slice pool: the slice it runs on
    processes: list["RunProcessPublic"] = []  # and its process on each host of it


class RunProcessPublic(SQLModel):
    host_index: int
    attempt: int
    worker: str
    state: str
    step: int
    step_time_s: float | None
    heartbeat_at: datetime


class RunsPublic(SQLModel):
    data: list[RunPublic]
    count: int
