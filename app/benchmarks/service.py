"""Benchmarks of endpoints: the state machine (queued -> running -> succeeded | failed), advanced by the
`tunedeck.benchmarks.run` task on the endpoint's pool (worker/benchmarks.py), which sends the load
from the endpoint's host and records each level here as it completes."""

from __future__ import annotations

from sqlmodel import Session

from app.auth.models import User
from app.benchmarks.models import Benchmark, BenchmarkCreate, BenchmarkPublic, BenchmarkStatus
from app.core import queue
from app.core.db import claim, owned, owned_page, utcnow
from app.core.errors import FieldError
from app.core.security import new_id
from app.datasets.models import Dataset, DatasetStatus
from app.endpoints.models import Endpoint, EndpointStatus
from app.pools.models import Pool


class BenchmarkError(FieldError):
    pass


def to_public(benchmark: Benchmark) -> BenchmarkPublic:
    return BenchmarkPublic.model_validate(benchmark)


def create(session: Session, owner: User, data: BenchmarkCreate) -> Benchmark:
    endpoint = session.get(Endpoint, data.endpoint_id)
    if endpoint is None or endpoint.owner_id != owner.id:
        raise BenchmarkError("endpoint_id", f"unknown endpoint {data.endpoint_id!r}")
    if endpoint.status != EndpointStatus.ready:
        raise BenchmarkError("endpoint_id", f"endpoint {endpoint.id} is {endpoint.status}; benchmark a ready one")
    if data.dataset_id is not None:
        dataset = session.get(Dataset, data.dataset_id)
        if dataset is None or dataset.owner_id != owner.id:
            raise BenchmarkError("dataset_id", f"unknown dataset {data.dataset_id!r}")
        if dataset.status != DatasetStatus.ready or not dataset.valid_rows:
            raise BenchmarkError("dataset_id", f"dataset {dataset.id} is {dataset.status}; its prompts cannot be used")
    pool = session.get(Pool, endpoint.pool)
    config = data.model_dump(exclude={"endpoint_id"})
    levels = len(data.concurrency) + len(data.request_rates)
    assert owner.id is not None, "the owner is a saved user"
    benchmark = Benchmark(
        id=new_id("bm"),
        owner_id=owner.id,
        endpoint_id=endpoint.id,
        model=endpoint.model,
        pool=endpoint.pool,
        runtime=endpoint.runtime,
        chips=pool.chips if pool else 1,
        price_per_chip_hour=pool.price_per_chip_hour if pool else 0.0,
        config=config,
        requests_total=levels * data.num_prompts,
    )
    session.add(benchmark)
    session.commit()
    queue.send_task(queue.RUN_BENCHMARK, benchmark.id, queue=endpoint.pool)
    return benchmark


def list_benchmarks(
    session: Session, owner: User, *, endpoint_id: str | None = None, limit: int = 100, offset: int = 0
) -> list[Benchmark]:
    return owned_page(session, Benchmark, owner, limit=limit, offset=offset, endpoint_id=endpoint_id)


def get(session: Session, owner: User, benchmark_id: str) -> Benchmark | None:
    return owned(session, Benchmark, owner, benchmark_id)


def delete(session: Session, benchmark: Benchmark) -> None:
    if benchmark.status == BenchmarkStatus.running:
        raise BenchmarkError("status", f"benchmark {benchmark.id} is running", conflict=True)
    session.delete(benchmark)
    session.commit()


# --- worker side --------------------------------------------------------------------------------


def start(session: Session, benchmark_id: str) -> Benchmark | None:
    """The task takes the benchmark; None when it is not queued any more. It fails at once when its
    endpoint is no longer ready."""
    benchmark = session.get(Benchmark, benchmark_id)
    if benchmark is None or benchmark.status != BenchmarkStatus.queued:
        return None
    if not claim(session, benchmark, status=BenchmarkStatus.running, started_at=utcnow(), updated_at=utcnow()):
        return None
    endpoint = session.get(Endpoint, benchmark.endpoint_id) if benchmark.endpoint_id else None
    if endpoint is None or endpoint.status != EndpointStatus.ready:
        state = endpoint.status if endpoint else "deleted"
        fail(session, benchmark, f"endpoint {benchmark.endpoint_id} is {state}")
        return None
    return benchmark


def progress(session: Session, benchmark: Benchmark, requests_done: int) -> None:
    benchmark.requests_done = requests_done
    benchmark.updated_at = utcnow()
    session.add(benchmark)
    session.commit()


def add_level(session: Session, benchmark: Benchmark, level: dict) -> None:
    """A level's results, with their cost: the pool's chip-hours per million output tokens at the
    level's output throughput."""
    rate = level["output_throughput"]
    usd = benchmark.chips * benchmark.price_per_chip_hour / (rate * 3600) * 1e6 if rate > 0 else None
    benchmark.results = [*benchmark.results, {**level, "usd_per_million_output_tokens": usd}]
    benchmark.updated_at = utcnow()
    session.add(benchmark)
    session.commit()


def finish(session: Session, benchmark: Benchmark) -> None:
    _end(session, benchmark, BenchmarkStatus.succeeded, None)


def fail(session: Session, benchmark: Benchmark, error: str) -> None:
    _end(session, benchmark, BenchmarkStatus.failed, error[:2000])


def _end(session: Session, benchmark: Benchmark, status: BenchmarkStatus, error: str | None) -> None:
    benchmark.status = status
    benchmark.error = error
    benchmark.finished_at = benchmark.updated_at = utcnow()
    session.add(benchmark)
    session.commit()
