from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, Column, Index, Text
from sqlmodel import AutoString, Field, SQLModel

from app.core.db import utcnow
from app.core.schemas import ID_LENGTH, NAME_LENGTH, Schema


class EndpointStatus(StrEnum):
    pending = "pending"  # queued for a worker of its pool
    starting = "starting"  # the model server is starting (its phase says how far)
    ready = "ready"  # healthy: serving requests
    failed = "failed"  # it could not start, or its model server died (error says why)
    stopping = "stopping"  # stop requested; the worker is stopping it
    stopped = "stopped"


ACTIVE = {EndpointStatus.pending, EndpointStatus.starting, EndpointStatus.ready, EndpointStatus.stopping}


class Runtime(StrEnum):
    local = "local"  # the built-in model server (python -m worker.serve), on the worker's host: cpu pools
    vllm_tpu = "vllm-tpu"  # vLLM's TPU container on the worker's host (Docker Engine API): TPU pools
    vllm_gpu = "vllm-gpu"  # vLLM's GPU container: GPU pools


class Endpoint(SQLModel, table=True):
    __tablename__ = "endpoints"  # pyright: ignore[reportAssignmentType]
    __table_args__ = (Index("ix_endpoints_owner_created", "owner_id", "created_at", "id"),)
    id: str = Field(primary_key=True, max_length=32)
    owner_id: int = Field(foreign_key="users.id", ondelete="CASCADE")
    artifact_id: str = Field(foreign_key="artifacts.id", ondelete="CASCADE", index=True, max_length=32)
    model: str = Field(max_length=160, description="the served model id: the artifact's name")
    pool: str = Field(max_length=64)
    runtime: Runtime = Field(default=Runtime.local, sa_type=AutoString(16))
    status: EndpointStatus = Field(default=EndpointStatus.pending, index=True, sa_type=AutoString(16))
    phase: str | None = Field(default=None, max_length=32)  # loading, compiling, ... while starting
    waiting: str | None = Field(default=None, max_length=500)  # pending: what it waits for (a host's chips)
    settings: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    url: str | None = Field(default=None, max_length=255)  # the model server's base URL once started
    # The model server's bearer key, new at each start: only the gateway, the probes and benchmarks send it
    # (never in a public schema; the server answers no one else)
    api_key: str | None = Field(default=None, max_length=64)
    worker: str | None = Field(default=None, max_length=255)
    pid: int | None = None  # the endpoint's supervisor process on the worker's host
    heartbeat_at: datetime | None = None
    error: str | None = None
    log_tail: str | None = Field(default=None, sa_type=Text)  # the model server's latest output lines
    attempts: int = 0
    # The endpoint whose model this one takes over: it is stopped once this one is ready (a promotion)
    replaces_id: str | None = Field(default=None, foreign_key="endpoints.id", ondelete="SET NULL", max_length=32)
    created_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    ready_at: datetime | None = None
    stopped_at: datetime | None = None
    updated_at: datetime = Field(default_factory=utcnow)


class EndpointSample(SQLModel, table=True):
    """One request's latency and tokens: real traffic through the gateway, or a probe."""

    __tablename__ = "endpoint_samples"  # pyright: ignore[reportAssignmentType]
    __table_args__ = (Index("ix_endpoint_samples_endpoint_at", "endpoint_id", "at"),)
    id: int | None = Field(default=None, primary_key=True)
    endpoint_id: str = Field(foreign_key="endpoints.id", ondelete="CASCADE", max_length=32)
    at: datetime = Field(default_factory=utcnow)
    source: str = Field(max_length=16)  # "gateway" or "probe"
    ttft_s: float | None = None  # request sent -> first token
    duration_s: float  # request sent -> last byte
    output_tokens: int = 0
    status_code: int = 200
    error: str | None = Field(default=None, max_length=500)
    # Scraped from the model server's /metrics with a probe (vLLM's names): since the previous scrape
    server_ttft_s: float | None = None  # mean of vllm:time_to_first_token_seconds
    generation_tokens_per_s: float | None = None  # rate of vllm:generation_tokens_total
    running: int | None = None  # vllm:num_requests_running
    waiting: int | None = None  # vllm:num_requests_waiting
    kv_cache_usage: float | None = None  # vllm:kv_cache_usage_perc (0-1)


class EndpointSamplePublic(SQLModel):
    at: datetime
    source: str
    ttft_s: float | None
    duration_s: float
    output_tokens: int
    tokens_per_s: float | None  # output tokens after the first, per second of decoding
    status_code: int
    error: str | None
    server_ttft_s: float | None
    generation_tokens_per_s: float | None
    running: int | None
    waiting: int | None
    kv_cache_usage: float | None


class Figures(SQLModel):
    requests: int = 0
    errors: int = Field(default=0, description="requests answered with an HTTP error or broken off")
    ttft_p50_s: float | None = Field(default=None, description="time to first token, median (streamed requests)")
    ttft_p95_s: float | None = None
    itl_p50_s: float | None = Field(
        default=None,
        description="inter-token latency, median over requests of each one's mean gap between streamed tokens "
        "((duration - TTFT) / (output tokens - 1))",
    )
    output_tokens: int = 0
    output_tokens_per_s: float = Field(
        default=0.0, description="output tokens of these requests per second of the window"
    )
    server_tokens_per_s: float | None = Field(
        default=None,
        description="the model server's own generation rate (vllm:generation_tokens_total), mean of the scrapes",
    )


class BySource(SQLModel):
    all: Figures = Field(default_factory=Figures)
    probe: Figures = Field(default_factory=Figures)
    gateway: Figures = Field(default_factory=Figures)


class EndpointStats(SQLModel):
    last_5m: BySource
    last_1h: BySource


class SeriesPoint(SQLModel):
    at: datetime = Field(description="the middle of the bucket")
    figures: BySource


class EndpointSeries(SQLModel):
    bucket_s: int
    points: list[SeriesPoint]


class EndpointCreate(Schema):
    artifact_id: str = Field(max_length=ID_LENGTH)
    pool: str = Field(default="cpu", max_length=NAME_LENGTH)
    max_model_len: int = Field(default=1024, ge=16, le=1_048_576)
    max_num_seqs: int = Field(default=16, ge=1, le=1024)
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="vLLM pools: this many replicas of the model, each over the pool's chips / this many by tensor "
        "parallelism (vLLM's --data-parallel-size); 1 on the built-in server",
    )


class EndpointReplace(Schema):
    artifact_id: str = Field(max_length=ID_LENGTH, description="the merged artifact to serve under the model's name")


class EndpointPublic(SQLModel):
    id: str
    artifact_id: str
    model: str
    pool: str
    runtime: Runtime
    status: EndpointStatus
    phase: str | None
    waiting: str | None = None
    settings: dict[str, Any]
    url: str | None = Field(description="where its model server listens: shown to admins only (null for others)")
    error: str | None
    attempts: int
    replaces_id: str | None = Field(description="the endpoint it takes the model name over from, once ready")
    created_at: datetime
    started_at: datetime | None
    ready_at: datetime | None
    stopped_at: datetime | None
    cost_usd: float = 0.0  # chip-hours since it last started x its pool's price
    stats: EndpointStats | None = Field(
        default=None,
        description="live figures from its samples: on GET /endpoints/{id}, and in the list with ?stats=true",
    )


class EndpointsPublic(SQLModel):
    data: list[EndpointPublic]
    count: int


class EndpointCost(SQLModel):
    id: str
    model: str
    pool: str
    status: EndpointStatus
    cost_usd: float


class RunCost(SQLModel):
    """What a run has cost: its training, and the endpoints serving its artifacts."""

    run_id: str
    training_usd: float
    serving_usd: float
    total_usd: float
    endpoints: list[EndpointCost]
