"""Endpoints API: /api/v1/endpoints (merged artifacts served on a pool)."""

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response, status
from fastapi.responses import PlainTextResponse

from app.core import errors
from app.core.db import utcnow
from app.core.deps import CurrentUser, SessionDep
from app.core.routing import Route
from app.core.schemas import Offset
from app.core.sse import watch_body
from app.endpoints import service, stats
from app.endpoints.models import (
    Endpoint,
    EndpointCreate,
    EndpointPublic,
    EndpointReplace,
    EndpointSamplePublic,
    EndpointSeries,
    EndpointsPublic,
)

router = APIRouter(route_class=Route, prefix="/api/v1/endpoints", tags=["endpoints"])


def _get(session, user, endpoint_id: str) -> Endpoint:
    return errors.found(service.get(session, user, endpoint_id), "endpoint", endpoint_id)


def _fingerprint(e: dict) -> tuple:
    return e["id"], e["status"], e["phase"], e["error"]


@router.post("", response_model=EndpointPublic, status_code=status.HTTP_201_CREATED)
def create_endpoint(data: EndpointCreate, session: SessionDep, user: CurrentUser) -> EndpointPublic:
    """Deploy a merged artifact on a pool: a worker of the pool starts its model server."""
    try:
        return service.to_public(session, service.create(session, user, data), user)
    except service.EndpointError as exc:
        raise errors.answer(exc) from exc


@router.get("", response_model=EndpointsPublic)
def list_endpoints(
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    artifact_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
    stats: Annotated[bool, Query(description="each with its live figures (`stats`)")] = False,
    watch_: Annotated[bool, Query(alias="watch")] = False,
):
    """The user's endpoints, newest first; `?artifact_id=` filters; `?stats=true` adds each one's live
    figures; `?watch=true` streams the list (SSE)."""

    def listed(s) -> dict:
        rows = service.list_endpoints(s, user, artifact_id=artifact_id, limit=limit, offset=offset)
        data = service.with_stats(s, rows, user) if stats else [service.to_public(s, e, user) for e in rows]
        return EndpointsPublic(data=data, count=len(rows)).model_dump(mode="json")

    if not watch_:
        return listed(session)

    return watch_body(request, listed, lambda body: [_fingerprint(e) for e in body["data"]])


@router.get("/{endpoint_id}", response_model=EndpointPublic)
def get_endpoint(
    endpoint_id: str,
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    watch_: Annotated[bool, Query(alias="watch")] = False,
):
    """The endpoint, with its live figures over the last 5 minutes and hour (`stats`); `?watch=true` streams
    its state (SSE, without the figures)."""
    endpoint = _get(session, user, endpoint_id)
    if not watch_:
        return service.with_stats(session, [endpoint], user)[0]

    def load(s):
        current = service.get(s, user, endpoint_id)
        return None if current is None else service.to_public(s, current, user).model_dump(mode="json")

    return watch_body(request, load, _fingerprint)


@router.get("/{endpoint_id}/samples", response_model=list[EndpointSamplePublic])
def endpoint_samples(
    endpoint_id: str,
    session: SessionDep,
    user: CurrentUser,
    minutes: Annotated[int, Query(ge=1, le=7 * 24 * 60)] = 60,
) -> list[EndpointSamplePublic]:
    """Latency and throughput of the endpoint's requests (gateway traffic and probes), oldest first."""
    endpoint = _get(session, user, endpoint_id)
    return service.samples(session, endpoint, since=utcnow() - timedelta(minutes=minutes))


@router.get("/{endpoint_id}/stats", response_model=EndpointSeries)
def endpoint_series(
    endpoint_id: str,
    session: SessionDep,
    user: CurrentUser,
    minutes: Annotated[int, Query(ge=1, le=7 * 24 * 60)] = 60,
    bucket_s: Annotated[int, Query(ge=10, le=24 * 3600)] = 60,
) -> EndpointSeries:
    """The live figures per `bucket_s` seconds over the last `minutes` (what the endpoint page charts),
    oldest first; buckets without a request are left out."""
    if minutes * 60 // bucket_s > 1000:
        raise errors.unprocessable(
            f"{minutes} minutes in buckets of {bucket_s} s is over 1000 buckets", "bucket_s", where="query"
        )
    endpoint = _get(session, user, endpoint_id)
    return stats.series(session, endpoint.id, utcnow(), minutes, bucket_s)


@router.post("/{endpoint_id}/stop", response_model=EndpointPublic)
def stop_endpoint(endpoint_id: str, session: SessionDep, user: CurrentUser) -> EndpointPublic:
    """Stop serving: the model server's process ends and its port is freed."""
    return service.to_public(session, service.request_stop(session, _get(session, user, endpoint_id)), user)


@router.post("/{endpoint_id}/replace", response_model=EndpointPublic, status_code=status.HTTP_201_CREATED)
def replace_endpoint(endpoint_id: str, data: EndpointReplace, session: SessionDep, user: CurrentUser) -> EndpointPublic:
    """Promote another merged artifact into this ready endpoint's place, with no outage: a new endpoint
    on the same pool serves it under the same model name; the gateway moves the name's requests to it
    once it is ready, and this one stops after, finishing the requests it has. Answers the new endpoint
    (its `replaces_id` is this one)."""
    try:
        new = service.replace(session, user, _get(session, user, endpoint_id), data.artifact_id)
    except service.EndpointError as exc:
        raise errors.answer(exc) from exc
    return service.to_public(session, new, user)


@router.post("/{endpoint_id}/restart", response_model=EndpointPublic)
def restart_endpoint(endpoint_id: str, session: SessionDep, user: CurrentUser) -> EndpointPublic:
    """Start a failed or stopped endpoint again, as it was deployed (409 while it is active)."""
    try:
        return service.to_public(session, service.restart(session, _get(session, user, endpoint_id)), user)
    except service.EndpointError as exc:
        raise errors.answer(exc) from exc


@router.get("/{endpoint_id}/logs", response_class=PlainTextResponse)
def endpoint_logs(
    endpoint_id: str, session: SessionDep, user: CurrentUser, tail: Annotated[int, Query(ge=1, le=1000)] = 200
) -> PlainTextResponse:
    """The model server's latest output (its last ``tail`` lines), as its worker last copied it."""
    lines = (_get(session, user, endpoint_id).log_tail or "").splitlines()
    return PlainTextResponse("\n".join(lines[-tail:]))


@router.delete("/{endpoint_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_endpoint(endpoint_id: str, session: SessionDep, user: CurrentUser) -> Response:
    try:
        service.delete(session, _get(session, user, endpoint_id))
    except service.EndpointError as exc:
        raise errors.answer(exc) from exc
    return Response(status_code=status.HTTP_204_NO_CONTENT)
