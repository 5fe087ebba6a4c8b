"""Dataset pages: the list with the upload drop zone, and one dataset's report."""

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import RedirectResponse

from app.core import errors
from app.core.deps import CsrfChecked, SessionDep, WebUser
from app.core.routing import Route
from app.core.templating import render
from app.datasets import service
from app.datasets.models import DatasetPublic

router = APIRouter(route_class=Route, include_in_schema=False)


@router.get("/datasets")
def datasets_page(request: Request, session: SessionDep, user: WebUser):
    rows, count = service.list_datasets(session, user, limit=200)
    return render(request, "datasets/list.html", user, datasets=rows, count=count)


@router.get("/datasets/{dataset_id}")
def dataset_page(dataset_id: str, request: Request, session: SessionDep, user: WebUser):
    dataset = errors.found(service.get_dataset(session, user, dataset_id), "dataset", dataset_id)
    return render(
        request, "datasets/detail.html", user, dataset=DatasetPublic.model_validate(dataset).model_dump(mode="json")
    )


@router.post("/datasets/{dataset_id}/delete", dependencies=[CsrfChecked])
def delete_dataset(dataset_id: str, request: Request, session: SessionDep, user: WebUser):
    dataset = errors.found(service.get_dataset(session, user, dataset_id), "dataset", dataset_id)
    try:
        service.delete_dataset(session, dataset)
    except service.DatasetInUse as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    return RedirectResponse("/datasets", status_code=303)
