"""Native REST API for datasets: /api/v1/datasets."""

from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Header, HTTPException, Query, Request, status
from fastapi.responses import FileResponse

from app.core import errors, queue, security
from app.core.config import get_settings
from app.core.db import session_scope
from app.core.deps import CurrentUser, SessionDep
from app.core.routing import Route
from app.core.schemas import Offset
from app.core.sse import watch_body
from app.core.uploads import receive_multipart
from app.datasets import service
from app.datasets.models import Dataset, DatasetPublic, DatasetsPublic, DatasetStatus, DatasetSummary

router = APIRouter(route_class=Route, prefix="/api/v1/datasets", tags=["datasets"])
# A worker on another host fetches a dataset's file here (worker/model_cache.local_dataset).
worker_router = APIRouter(route_class=Route, prefix="/internal/datasets", include_in_schema=False)

UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "file_type": {"type": "string", "enum": list(service.FILE_TYPES)},
                        "format": {"type": "string", "enum": list(service.FORMATS)},
                    },
                }
            }
        },
    }
}


async def receive_dataset(request: Request, user, *, purpose_field: bool = False) -> Dataset:
    """Shared by the native and the OpenAI upload routes."""
    settings = get_settings()
    await anyio.to_thread.run_sync(queue.check_broker)  # before the upload is received, not after
    form = await receive_multipart(request, service.incoming_dir(settings), settings.max_upload_bytes)
    try:
        upload = form.files.get("file")
        if upload is None:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "form field 'file' is required")
        purpose = form.fields.get("purpose", "") if purpose_field else "fine-tune"
        if not purpose:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "form field 'purpose' is required")
        with session_scope() as session:
            try:
                return service.create_from_upload(
                    session,
                    user,
                    upload,
                    file_type=form.fields.get("file_type") or None,
                    fmt=form.fields.get("format") or None,
                    purpose=purpose,
                )
            except service.InvalidOption as exc:
                raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"form field '{exc.field}': {exc}") from exc
    finally:
        form.discard()


@router.post("", status_code=status.HTTP_201_CREATED, response_model=DatasetPublic, openapi_extra=UPLOAD_BODY)
async def upload_dataset(request: Request, user: CurrentUser) -> Dataset:
    """Upload a dataset file (multipart field `file`; optional `file_type`, `format` overrides)."""
    return await receive_dataset(request, user)


@router.post("/demo", status_code=status.HTTP_201_CREATED, response_model=DatasetPublic)
def import_demo(session: SessionDep, user: CurrentUser) -> Dataset:
    """Import the demo dataset (a toy chat task the tiny model learns on CPU in minutes)."""
    return service.create_demo(session, user)


@router.get("", response_model=DatasetsPublic)
def list_datasets(
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
    status_: Annotated[DatasetStatus | None, Query(alias="status")] = None,
    watch_: Annotated[bool, Query(alias="watch")] = False,
):
    """Newest first; with `?watch=true`, a server-sent event stream of this page of the list."""

    def page(s) -> DatasetsPublic:
        rows, count = service.list_datasets(s, user, limit=limit, offset=offset, status=status_)
        return DatasetsPublic(data=[DatasetSummary.model_validate(r) for r in rows], count=count)

    if not watch_:
        return page(session)
    return watch_body(
        request,
        lambda s: page(s).model_dump(mode="json"),
        lambda body: [(d["id"], d["status"], d["progress_bytes"]) for d in body["data"]],
    )


@router.get("/{dataset_id}", response_model=DatasetPublic)
def get_dataset(
    dataset_id: str,
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    watch_: Annotated[bool, Query(alias="watch")] = False,
):
    """One dataset; with `?watch=true`, a server-sent event stream of it, sent on every change."""
    dataset = service.get_dataset(session, user, dataset_id)
    if dataset is None:
        raise errors.not_found("dataset", dataset_id)
    if not watch_:
        return dataset

    def load(s):
        current = service.get_dataset(s, user, dataset_id)
        return None if current is None else DatasetPublic.model_validate(current).model_dump(mode="json")

    return watch_body(request, load, lambda body: body)


@router.get("/{dataset_id}/content")
def dataset_content(dataset_id: str, session: SessionDep, user: CurrentUser) -> FileResponse:
    dataset = service.get_dataset(session, user, dataset_id)
    if dataset is None:
        raise errors.not_found("dataset", dataset_id)
    return FileResponse(service.file_path(dataset), filename=dataset.filename, media_type="application/octet-stream")


@worker_router.get("/{dataset_id}/file")
def worker_download_file(
    dataset_id: str,
    session: SessionDep,
    token: Annotated[str, Header(alias=security.WORKER_TOKEN_HEADER, max_length=500)] = "",
) -> FileResponse:
    if not security.worker_token_allows(token, dataset_id):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"no worker credential for dataset {dataset_id} (is TUNEDECK_SECRET_KEY the same on every host?)",
        )
    dataset = errors.found(session.get(Dataset, dataset_id), "dataset", dataset_id)
    return FileResponse(service.file_path(dataset), filename=dataset.filename, media_type="application/octet-stream")


@router.delete("/{dataset_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_dataset(dataset_id: str, session: SessionDep, user: CurrentUser) -> None:
    dataset = service.get_dataset(session, user, dataset_id)
    if dataset is None:
        raise errors.not_found("dataset", dataset_id)
    try:
        service.delete_dataset(session, dataset)
    except service.DatasetInUse as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
