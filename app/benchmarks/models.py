"""A benchmark: load sent to an endpoint, level by level, and its latency and throughput, with the
definitions of `vllm bench serve` (TTFT, TPOT, ITL, E2E latency; request and token throughput)."""

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import field_validator, model_validator
from sqlalchemy import JSON, Column, Index
from sqlmodel import AutoString, Field, SQLModel

from app.core.db import utcnow
from app.core.schemas import ID_LENGTH, INT32_MAX, Schema

MAX_LEVELS = 12


class BenchmarkStatus(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"  # the load could not be sent, or its worker went silent (error says why)
    cancelled = "cancelled"  # the user cancelled it; the levels finished before stay


TERMINAL = {BenchmarkStatus.succeeded, BenchmarkStatus.failed, BenchmarkStatus.cancelled}


class BenchmarkConfig(Schema):
    """What load to send. ``concurrency`` mode keeps that many requests in flight (a sweep: one level
    per value); ``rate`` mode sends requests at Poisson arrivals of that many per second (one level per
    rate), at most ``max_concurrency`` at a time when set."""

    mode: Literal["concurrency", "rate"] = "concurrency"
    concurrency: list[int] = Field(default=[1, 4, 16], description="requests in flight, one level per value")
    request_rates: list[float] = Field(default=[1.0], description="requests per second (rate mode), one level each")
    max_concurrency: int | None = Field(
        default=None, ge=1, le=4096, description="rate mode: a cap on requests in flight"
    )
    num_prompts: int = Field(default=32, ge=1, le=10_000, description="requests per level")
    input_len: int = Field(default=128, ge=1, le=131_072, description="tokens per random prompt")
    output_len: int = Field(default=64, ge=1, le=32_768, description="tokens per reply (end-of-sequence ignored)")
    dataset_id: str | None = Field(
        default=None, max_length=ID_LENGTH, description="prompts from this dataset's conversations, not random"
    )
    seed: int = Field(default=0, ge=0, le=INT32_MAX)
    percentile_metrics: list[Literal["ttft", "tpot", "itl", "e2el"]] = Field(
        default=["ttft", "tpot", "itl"],
        description="the metrics to report percentiles of (vLLM's --percentile-metrics)",
    )
    metric_percentiles: list[float] = Field(
        default=[99.0], description="the percentiles to report, e.g. [50, 90, 99] (vLLM's --metric-percentiles)"
    )
    goodput: dict[Literal["ttft", "tpot", "e2el"], float] | None = Field(
        default=None,
        description='SLOs in ms, e.g. {"ttft": 500, "tpot": 50}: each level\'s request_goodput counts the completed '
        "requests within all of them per second (vLLM's --goodput ttft:500 tpot:50)",
    )

    @field_validator("percentile_metrics")
    @classmethod
    def _percentile_metrics(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("give at least one of ttft, tpot, itl, e2el")
        return list(dict.fromkeys(v))

    @field_validator("metric_percentiles")
    @classmethod
    def _metric_percentiles(cls, v: list[float]) -> list[float]:
        if not 1 <= len(v) <= 10 or any(not 0 < p < 100 for p in v):
            raise ValueError("give 1 to 10 percentiles, each above 0 and below 100")
        return sorted(set(v))

    @field_validator("goodput")
    @classmethod
    def _goodput(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and (not v or any(not 0 <= ms <= 3_600_000 for ms in v.values())):
            raise ValueError("give SLOs for some of ttft, tpot, e2el, each from 0 to 3600000 ms")
        return v

    @field_validator("concurrency")
    @classmethod
    def _concurrency(cls, v: list[int]) -> list[int]:
        if not 1 <= len(v) <= MAX_LEVELS or any(not 1 <= c <= 4096 for c in v):
            raise ValueError(f"give 1 to {MAX_LEVELS} values, each from 1 to 4096")
        return sorted(set(v))

    @field_validator("request_rates")
    @classmethod
    def _rates(cls, v: list[float]) -> list[float]:
        if not 1 <= len(v) <= MAX_LEVELS or any(not 0 < r <= 10_000 for r in v):
            raise ValueError(f"give 1 to {MAX_LEVELS} rates, each above 0 and at most 10000 per second")
        return sorted(set(v))

    @model_validator(mode="after")
    def _levels(self):
        if self.mode == "concurrency":
            self.request_rates = []
            self.max_concurrency = None
        else:
            self.concurrency = []
        return self


class BenchmarkCreate(BenchmarkConfig):
    endpoint_id: str = Field(max_length=ID_LENGTH)


class Benchmark(SQLModel, table=True):
    __tablename__ = "benchmarks"  # pyright: ignore[reportAssignmentType]
    __table_args__ = (Index("ix_benchmarks_owner_created", "owner_id", "created_at", "id"),)
    id: str = Field(primary_key=True, max_length=32)
    owner_id: int = Field(foreign_key="users.id", ondelete="CASCADE")
    # Kept when the endpoint is deleted: results stay comparable, described by the copies below.
    endpoint_id: str | None = Field(
        default=None, foreign_key="endpoints.id", ondelete="SET NULL", index=True, max_length=32
    )
    model: str = Field(max_length=160)
    pool: str = Field(max_length=64)
    runtime: str = Field(max_length=16)
    chips: int
    price_per_chip_hour: float  # the pool's, when the benchmark was made: its cost per token
    status: BenchmarkStatus = Field(default=BenchmarkStatus.queued, index=True, sa_type=AutoString(16))
    config: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    results: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    requests_done: int = 0
    requests_total: int = 0
    error: str | None = None
    attempts: int = 0  # deliveries of its task that took it (``claim``): one
    worker: str | None = Field(default=None, max_length=255)  # the worker sending its load
    heartbeat_at: datetime | None = None  # beaten by that worker while it runs
    cancel_requested: bool = False  # the user cancelled it; its worker stops the load at its next beat
    created_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    updated_at: datetime = Field(default_factory=utcnow)


class Stat(SQLModel):
    mean: float | None
    median: float | None
    std: float | None = None
    percentiles: dict[str, float] = Field(
        default_factory=dict, description="by percentile (p99, p99.9): for the benchmark's percentile_metrics"
    )

    @model_validator(mode="before")
    @classmethod
    def _stored_before_percentiles(cls, data: Any) -> Any:
        """Levels stored before the percentiles were chosen have their p99 on its own."""
        if isinstance(data, dict) and "p99" in data and "percentiles" not in data:
            p99 = data.get("p99")
            data = {**data, "percentiles": {} if p99 is None else {"p99": p99}}
        return data


class BenchmarkLevel(SQLModel):
    """One level of load: what `vllm bench serve` prints for a run."""

    concurrency: int | None  # concurrency mode
    request_rate: float | None  # rate mode
    completed: int
    failed: int
    errors: list[str]  # the first few failures' messages
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests per second
    request_goodput: float | None = None  # completed requests within the benchmark's goodput SLOs per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # input + output tokens per second
    ttft_ms: Stat  # request sent -> first chunk with choices (text or not)
    tpot_ms: Stat  # (E2E - TTFT) / (output tokens - 1), per request
    itl_ms: Stat  # gaps between chunks with choices, over all requests
    e2el_ms: Stat  # request sent -> last chunk
    usd_per_million_output_tokens: float | None  # the pool's chip-hours at this output throughput


class BenchmarkPublic(SQLModel):
    id: str
    endpoint_id: str | None
    model: str
    pool: str
    runtime: str
    chips: int
    price_per_chip_hour: float
    status: BenchmarkStatus
    config: dict[str, Any]
    results: list[BenchmarkLevel]
    requests_done: int
    requests_total: int
    error: str | None
    cancel_requested: bool  # cancelled while running: its worker is stopping the load
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class BenchmarksPublic(SQLModel):
    data: list[BenchmarkPublic]
    count: int
