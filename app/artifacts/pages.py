"""Artifact pages: the list, and one artifact live."""

from fastapi import APIRouter, Request

from app.artifacts import service
from app.core import errors
from app.core.deps import SessionDep, WebUser
from app.core.routing import Route
from app.core.templating import render

router = APIRouter(route_class=Route, include_in_schema=False)


@router.get("/artifacts")
def artifacts_page(request: Request, user: WebUser):
    return render(request, "artifacts/list.html", user)


@router.get("/artifacts/{artifact_id}")
def artifact_page(artifact_id: str, request: Request, session: SessionDep, user: WebUser):
    artifact = errors.found(service.get(session, user, artifact_id), "artifact", artifact_id)
    return render(request, "artifacts/detail.html", user, artifact=service.to_public(artifact).model_dump(mode="json"))
