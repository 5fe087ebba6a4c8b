"""Evaluation pages: the list, and one evaluation live (progress, the summary with intervals, the samples)."""

from fastapi import APIRouter, Request

from app.core import errors
from app.core.deps import SessionDep, WebUser
from app.core.routing import Route
from app.core.templating import render
from app.evaluations import service

router = APIRouter(route_class=Route, include_in_schema=False)


@router.get("/evaluations")
def evaluations_page(request: Request, user: WebUser):
    return render(request, "evaluations/list.html", user)


@router.get("/evaluations/{evaluation_id}")
def evaluation_page(evaluation_id: str, request: Request, session: SessionDep, user: WebUser):
    evaluation = errors.found(service.get(session, user, evaluation_id), "evaluation", evaluation_id)
    return render(
        request, "evaluations/detail.html", user, evaluation=service.to_public(evaluation).model_dump(mode="json")
    )
