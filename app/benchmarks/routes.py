"""Benchmarks API: /api/v1/benchmarks (load sent to a ready endpoint, its latency and throughput)."""

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response, status

from app.benchmarks import service
from app.benchmarks.models import Benchmark, BenchmarkCreate, BenchmarkPublic, BenchmarksPublic
from app.core import errors
from app.core.deps import CurrentUser, SessionDep
from app.core.routing import Route
from app.core.schemas import Offset
from app.core.sse import watch_body

router = APIRouter(route_class=Route, prefix="/api/v1/benchmarks", tags=["benchmarks"])


def _get(session, user, benchmark_id: str) -> Benchmark:
    return errors.found(service.get(session, user, benchmark_id), "benchmark", benchmark_id)


@router.post("", response_model=BenchmarkPublic, status_code=status.HTTP_201_CREATED)
def create_benchmark(data: BenchmarkCreate, session: SessionDep, user: CurrentUser) -> BenchmarkPublic:
    """Benchmark a ready endpoint: a worker of its pool sends the load, level by level (a sweep over
    concurrency, or Poisson arrivals at request rates), and records each level's latency and throughput."""
    try:
        return service.to_public(service.create(session, user, data))
    except service.BenchmarkError as exc:
        raise errors.answer(exc) from exc


@router.get("", response_model=BenchmarksPublic)
def list_benchmarks(
    session: SessionDep,
    user: CurrentUser,
    endpoint_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
) -> BenchmarksPublic:
    """The user's benchmarks, newest first (`?endpoint_id=` filters), results included: comparable
    across endpoints and pools."""
    rows = service.list_benchmarks(session, user, endpoint_id=endpoint_id, limit=limit, offset=offset)
    return BenchmarksPublic(data=[service.to_public(b) for b in rows], count=len(rows))


@router.get("/{benchmark_id}", response_model=BenchmarkPublic)
def get_benchmark(
    benchmark_id: str,
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    watch_: Annotated[bool, Query(alias="watch")] = False,
):
    """One benchmark; `?watch=true` streams it (SSE) as its levels complete."""
    benchmark = _get(session, user, benchmark_id)
    if not watch_:
        return service.to_public(benchmark)

    def load(s):
        current = service.get(s, user, benchmark_id)
        return None if current is None else service.to_public(current).model_dump(mode="json")

    return watch_body(request, load, lambda body: (body["status"], body["requests_done"], len(body["results"])))


@router.post("/{benchmark_id}/cancel", response_model=BenchmarkPublic)
def cancel_benchmark(benchmark_id: str, session: SessionDep, user: CurrentUser) -> BenchmarkPublic:
    """Cancel a queued or running benchmark: a queued one is `cancelled` at once; a running one's worker
    stops sending requests within a second or so (`cancel_requested` until then) and ends it `cancelled`,
    keeping the levels it finished. 409 when it has already ended."""
    try:
        return service.to_public(service.cancel(session, _get(session, user, benchmark_id)))
    except service.BenchmarkError as exc:
        raise errors.answer(exc) from exc


@router.delete("/{benchmark_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_benchmark(benchmark_id: str, session: SessionDep, user: CurrentUser) -> Response:
    try:
        service.delete(session, _get(session, user, benchmark_id))
    except service.BenchmarkError as exc:
        raise errors.answer(exc) from exc
    return Response(status_code=status.HTTP_204_NO_CONTENT)
