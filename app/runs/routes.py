"""Native REST API for runs: /api/v1/runs."""

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, Response, status

from app.core import errors
from app.core.db import session_scope
from app.core.deps import CurrentUser, SessionDep
from app.core.routing import Route
from app.core.schemas import INT32_MAX, Offset
from app.core.sse import watch
from app.endpoints import service as endpoints
from app.endpoints.models import EndpointCost, RunCost
from app.runs import service
from app.runs.models import Run, RunCreate, RunPublic, RunsPublic, RunStatus

router = APIRouter(route_class=Route, prefix="/api/v1/runs", tags=["runs"])


def unprocessable(exc: service.RunInvalid) -> HTTPException:
    return errors.unprocessable(exc.message, *exc.loc)


def get_or_404(session, user, run_id: str) -> Run:
    return errors.found(service.get(session, user, run_id), "run", run_id)


@router.post("", response_model=RunPublic, status_code=status.HTTP_201_CREATED)
def create_run(data: RunCreate, session: SessionDep, user: CurrentUser) -> RunPublic:
    """Launch a LoRA fine-tune. Bad requests get 422 naming the field, and nothing is queued."""
    try:
        return service.to_public(session, service.create(session, user, data))
    except service.RunInvalid as exc:
        raise unprocessable(exc) from exc


@router.post("/estimate")
def estimate_run(data: RunCreate, session: SessionDep, user: CurrentUser) -> dict:
    """Pre-flight: parameters, LoRA parameters, memory per chip (with and without remat), time and cost."""
    try:
        return service.preflight(session, user, data).as_dict()
    except service.RunInvalid as exc:
        raise unprocessable(exc) from exc


@router.get("", response_model=RunsPublic)
def list_runs(
    session: SessionDep,
    user: CurrentUser,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
    status_: Annotated[RunStatus | None, Query(alias="status")] = None,
) -> RunsPublic:
    rows, count = service.list_runs(session, user, limit=limit, offset=offset, status=status_)
    return RunsPublic(data=[service.to_public(session, r) for r in rows], count=count)


@router.get("/{run_id}/cost", response_model=RunCost)
def run_cost(run_id: str, session: SessionDep, user: CurrentUser) -> RunCost:
    """The run's training cost, plus its endpoints' (chip-hours x pool price each), and their total."""
    run = get_or_404(session, user, run_id)
    training = service.cost_usd(session, run)
    served = endpoints.run_costs(session, run.id)
    serving = sum(cost for _, cost in served)
    return RunCost(
        run_id=run.id,
        training_usd=round(training, 6),
        serving_usd=round(serving, 6),
        total_usd=round(training + serving, 6),
        endpoints=[
            EndpointCost(id=e.id, model=e.model, pool=e.pool, status=e.status, cost_usd=round(c, 6)) for e, c in served
        ],
    )


@router.get("/{run_id}", response_model=RunPublic)
def get_run(
    run_id: str,
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    watch_: Annotated[bool, Query(alias="watch")] = False,
):
    """One run; with `?watch=true`, server-sent events: the run and its new metric points."""
    run = get_or_404(session, user, run_id)
    if not watch_:
        return service.to_public(session, run)
    last_id = [0]

    def snapshot():
        with session_scope() as s:
            current = service.get(s, user, run_id)
            if current is None:
                return None
            points = service.metrics(s, current, after_id=last_id[0])
            if points:
                assert points[-1].id is not None, "a metric row read back has its id"
                last_id[0] = points[-1].id
            payload = {
                "run": service.to_public(s, current).model_dump(mode="json"),
                "metrics": [{"step": p.step, **p.values} for p in points],
            }
            return (current.updated_at, current.status, current.phase, last_id[0]), payload

    return watch(request, snapshot)


@router.get("/{run_id}/metrics")
def run_metrics(
    run_id: str, session: SessionDep, user: CurrentUser, since_step: Annotated[int, Query(ge=-1, le=INT32_MAX)] = -1
) -> dict:
    run = get_or_404(session, user, run_id)
    points = service.metrics(session, run, since_step=since_step)
    return {"data": [{"step": p.step, **p.values} for p in points], "count": len(points)}


@router.get("/{run_id}/checkpoints")
def run_checkpoints(run_id: str, session: SessionDep, user: CurrentUser) -> dict:
    run = get_or_404(session, user, run_id)
    rows = service.checkpoints(session, run)
    return {
        "data": [{"step": c.step, "metrics": c.metrics, "created_at": c.created_at} for c in rows],
        "count": len(rows),
    }


@router.get("/{run_id}/events")
def run_events(run_id: str, session: SessionDep, user: CurrentUser, limit: Annotated[int, Query(ge=1, le=1000)] = 100):
    run = get_or_404(session, user, run_id)
    rows = service.events(session, run, limit=limit)
    return {
        "data": [{"id": e.id, "created_at": e.created_at, "level": e.level, "message": e.message} for e in rows],
        "count": len(rows),
    }


def _act(action, run_id: str, session, user) -> RunPublic:
    try:
        return service.to_public(session, action(session, get_or_404(session, user, run_id)))
    except service.StateError as exc:
        raise errors.conflict(str(exc)) from exc


@router.post("/{run_id}/cancel", response_model=RunPublic)
def cancel_run(run_id: str, session: SessionDep, user: CurrentUser) -> RunPublic:
    return _act(service.cancel, run_id, session, user)


@router.post("/{run_id}/pause", response_model=RunPublic)
def pause_run(run_id: str, session: SessionDep, user: CurrentUser) -> RunPublic:
    return _act(service.pause, run_id, session, user)


@router.post("/{run_id}/resume", response_model=RunPublic)
def resume_run(run_id: str, session: SessionDep, user: CurrentUser) -> RunPublic:
    return _act(service.resume, run_id, session, user)


@router.delete("/{run_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_run(run_id: str, session: SessionDep, user: CurrentUser) -> Response:
    """Delete a finished run with its events, metrics, checkpoints and logs. 409 while it is active (cancel
    it first) or while artifacts made from it exist (delete them first: the answer names them)."""
    try:
        service.delete(session, get_or_404(session, user, run_id))
    except service.StateError as exc:
        raise errors.conflict(str(exc)) from exc
    return Response(status_code=status.HTTP_204_NO_CONTENT)
