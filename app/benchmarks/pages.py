"""The benchmarks page: every finished benchmark, their latency/throughput curves side by side."""

from fastapi import APIRouter, Request

from app.core.deps import WebUser
from app.core.routing import Route
from app.core.templating import render

router = APIRouter(route_class=Route, include_in_schema=False)


@router.get("/benchmarks")
def benchmarks_page(request: Request, user: WebUser):
    return render(request, "benchmarks/list.html", user)
