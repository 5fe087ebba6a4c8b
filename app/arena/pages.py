"""The arena page: two endpoints answer side by side, names hidden until the vote; the standings."""

from fastapi import APIRouter, Request

from app.core.deps import WebUser
from app.core.routing import Route
from app.core.templating import render

router = APIRouter(route_class=Route, include_in_schema=False)


@router.get("/arena")
def arena_page(request: Request, user: WebUser):
    return render(request, "arena/arena.html", user)
