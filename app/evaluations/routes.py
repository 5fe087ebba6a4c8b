"""Evaluations API: /api/v1/evaluations (subjects asked an eval set's prompts, replies scored against
its references; per-sample rows, a summary with confidence intervals, a JSONL download)."""

from typing import Annotated, Literal

import orjson
from fastapi import APIRouter, Query, Request, Response, status
from fastapi.responses import StreamingResponse

from app.core import errors
from app.core.db import session_scope
from app.core.deps import CurrentUser, SessionDep
from app.core.routing import Route
from app.core.schemas import Offset
from app.core.sse import watch_body
from app.endpoints import service as endpoints
from app.endpoints.models import EndpointPublic
from app.evaluations import service
from app.evaluations.models import (
    Evaluation,
    EvaluationComparison,
    EvaluationCreate,
    EvaluationPublic,
    EvaluationSamplePublic,
    EvaluationSamplesPublic,
    EvaluationsPublic,
    Promotion,
)

router = APIRouter(route_class=Route, prefix="/api/v1/evaluations", tags=["evaluations"])


def _get(session, user, evaluation_id: str) -> Evaluation:
    return errors.found(service.get(session, user, evaluation_id), "evaluation", evaluation_id)


@router.post("", response_model=EvaluationPublic, status_code=status.HTTP_201_CREATED)
def create_evaluation(data: EvaluationCreate, session: SessionDep, user: CurrentUser) -> EvaluationPublic:
    """Evaluate subjects (run checkpoints, ready endpoints, base models) on a dataset's conversations: each
    answers the messages before the last assistant message, greedily, and its reply is scored against that
    message with each metric. Checkpoints and base models are served for the evaluation on their run's
    pool, and stopped after. A subject that is not the caller's is 404."""
    try:
        return service.to_public(service.create(session, user, data))
    except service.EvaluationError as exc:
        raise errors.answer(exc) from exc


@router.get("", response_model=EvaluationsPublic)
def list_evaluations(
    session: SessionDep,
    user: CurrentUser,
    run_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
) -> EvaluationsPublic:
    """The user's evaluations, newest first (`?run_id=` filters), summaries included."""
    rows = service.list_evaluations(session, user, run_id=run_id, limit=limit, offset=offset)
    return EvaluationsPublic(data=[service.to_public(e) for e in rows], count=len(rows))


@router.get("/compare", response_model=EvaluationComparison)
def compare_runs(
    session: SessionDep, user: CurrentUser, run_ids: Annotated[str, Query(max_length=2000)]
) -> EvaluationComparison:
    """Runs compared by their evaluations (`?run_ids=run-a,run-b`): per eval set (the same records), each
    evaluated checkpoint and base model with its scores and its evaluation's cost, and the run settings
    that differ. The runs compare page shows it."""
    ids = [i for i in run_ids.split(",") if i]
    try:
        groups = service.compare_runs(session, user, ids)
    except service.EvaluationError as exc:
        raise errors.answer(exc) from exc
    return EvaluationComparison(run_ids=ids, data=groups, count=len(groups))


@router.get("/{evaluation_id}", response_model=EvaluationPublic)
def get_evaluation(
    evaluation_id: str,
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    watch_: Annotated[bool, Query(alias="watch")] = False,
):
    """One evaluation; `?watch=true` streams it (SSE) as it goes."""
    evaluation = _get(session, user, evaluation_id)
    if not watch_:
        return service.to_public(evaluation)

    def load(s):
        current = service.get(s, user, evaluation_id)
        return None if current is None else service.to_public(current).model_dump(mode="json")

    return watch_body(request, load, lambda body: (body["status"], body["samples_done"], body["phase"]))


@router.get("/{evaluation_id}/samples", response_model=EvaluationSamplesPublic)
def list_samples(
    evaluation_id: str,
    session: SessionDep,
    user: CurrentUser,
    order: Literal["position", "spread"] = "position",
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
) -> EvaluationSamplesPublic:
    """The scored samples: in eval-set order, or `order=spread` for where the subjects differ most first.
    `count` is how many there are in all."""
    rows, total = service.samples(session, _get(session, user, evaluation_id), order=order, limit=limit, offset=offset)
    return EvaluationSamplesPublic(data=[EvaluationSamplePublic.model_validate(r) for r in rows], count=total)


@router.get("/{evaluation_id}/samples.jsonl")
def download_samples(evaluation_id: str, session: SessionDep, user: CurrentUser) -> StreamingResponse:
    """Every sample as a line of JSON: position, messages, reference, each subject's output and scores
    (keyed by the subject's key; `subjects` in the evaluation names them)."""
    evaluation = _get(session, user, evaluation_id)

    def lines():
        with session_scope() as s:
            for row in service.iter_samples(s, evaluation.id):
                yield orjson.dumps(EvaluationSamplePublic.model_validate(row).model_dump(mode="json")) + b"\n"

    headers = {"Content-Disposition": f'attachment; filename="{evaluation.id}-samples.jsonl"'}
    return StreamingResponse(lines(), media_type="application/x-ndjson", headers=headers)


@router.post("/{evaluation_id}/promote", response_model=EndpointPublic, status_code=status.HTTP_201_CREATED)
def promote(evaluation_id: str, data: Promotion, session: SessionDep, user: CurrentUser) -> EndpointPublic:
    """Deploy a checkpoint subject (the merge made for the evaluation) in one action: in the place of a
    ready endpoint (`endpoint_id`), which keeps its model name while its callers move to the new model
    with no outage (see `POST /api/v1/endpoints/{id}/replace`), or as a new endpoint. Answers the new
    endpoint."""
    try:
        endpoint = service.promote(session, user, _get(session, user, evaluation_id), data)
    except service.EvaluationError as exc:
        raise errors.answer(exc) from exc
    return endpoints.to_public(session, endpoint, user)


@router.post("/{evaluation_id}/cancel", response_model=EvaluationPublic)
def cancel_evaluation(evaluation_id: str, session: SessionDep, user: CurrentUser) -> EvaluationPublic:
    """Cancel a queued or running evaluation: its worker closes the requests in flight and stops what it
    serves within a second or so. 409 when it has already ended."""
    try:
        return service.to_public(service.cancel(session, _get(session, user, evaluation_id)))
    except service.EvaluationError as exc:
        raise errors.answer(exc) from exc


@router.delete("/{evaluation_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_evaluation(evaluation_id: str, session: SessionDep, user: CurrentUser) -> Response:
    try:
        service.delete(session, _get(session, user, evaluation_id))
    except service.EvaluationError as exc:
        raise errors.answer(exc) from exc
    return Response(status_code=status.HTTP_204_NO_CONTENT)
