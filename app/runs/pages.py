"""Run pages: the list, the launch form, one run live, and the compare view."""

from fastapi import APIRouter, Request

from app.base_models import service as base_models
from app.base_models.presets import HF_TARGET_MODULES
from app.core import errors
from app.core.deps import SessionDep, WebUser
from app.core.routing import Route
from app.core.templating import render
from app.datasets import service as datasets
from app.datasets.models import DatasetStatus
from app.pools import service as pools
from app.runs import service
from app.runs.models import RunConfig

router = APIRouter(route_class=Route, include_in_schema=False)


@router.get("/runs")
def runs_page(request: Request, session: SessionDep, user: WebUser):
    rows, count = service.list_runs(session, user, limit=200)
    return render(request, "runs/list.html", user, runs=[service.to_public(session, r) for r in rows], count=count)


@router.get("/runs/new")
def new_run_page(request: Request, session: SessionDep, user: WebUser, dataset: str | None = None):
    ready, _ = datasets.list_datasets(session, user, limit=500, status=DatasetStatus.ready)
    return render(
        request,
        "runs/new.html",
        user,
        datasets=ready,
        selected_dataset=dataset,
        base_models=base_models.list_models(session),
        pools=pools.list_pools(session),
        defaults=RunConfig().model_dump(),
        target_modules=HF_TARGET_MODULES,
    )


@router.get("/runs/compare")
def compare_page(request: Request, session: SessionDep, user: WebUser, ids: str = ""):
    chosen = [r for r in (service.get(session, user, i) for i in ids.split(",") if i) if r is not None]
    return render(
        request, "runs/compare.html", user, runs=[service.to_public(session, r).model_dump(mode="json") for r in chosen]
    )


@router.get("/runs/{run_id}")
def run_page(run_id: str, request: Request, session: SessionDep, user: WebUser):
    run = errors.found(service.get(session, user, run_id), "run", run_id)
    return render(request, "runs/detail.html", user, run=service.to_public(session, run).model_dump(mode="json"))
