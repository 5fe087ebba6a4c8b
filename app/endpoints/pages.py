"""Endpoint pages: the list, and one endpoint live (phase, latency and throughput charts, playground)."""

from fastapi import APIRouter, Request

from app.core import errors
from app.core.deps import SessionDep, WebUser
from app.core.routing import Route
from app.core.templating import render
from app.endpoints import service

router = APIRouter(route_class=Route, include_in_schema=False)


@router.get("/endpoints")
def endpoints_page(request: Request, user: WebUser):
    return render(request, "endpoints/list.html", user)


@router.get("/endpoints/{endpoint_id}")
def endpoint_page(endpoint_id: str, request: Request, session: SessionDep, user: WebUser):
    endpoint = errors.found(service.get(session, user, endpoint_id), "endpoint", endpoint_id)
    public = service.to_public(session, endpoint, user).model_dump(mode="json")
    return render(request, "endpoints/detail.html", user, endpoint=public)
