"""The dashboard's home page: an overview across domains."""

from fastapi import APIRouter, Request

from app.core.deps import SessionDep, WebUser
from app.core.routing import Route
from app.core.templating import render
from app.datasets import service as datasets
from app.pools import service as pools

router = APIRouter(route_class=Route, include_in_schema=False)


@router.get("/")
def home(request: Request, session: SessionDep, user: WebUser):
    recent, count = datasets.list_datasets(session, user, limit=5)
    return render(request, "home.html", user, pools=pools.list_pools(session), datasets=recent, dataset_count=count)
