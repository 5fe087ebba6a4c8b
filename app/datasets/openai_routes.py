"""OpenAI-compatible Files API (/v1/files): a thin adapter over the dataset service."""

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.responses import FileResponse

from app.core.deps import CurrentUser, SessionDep
from app.core.routing import Route
from app.datasets import service
from app.datasets.models import Dataset, DatasetStatus, OpenAIFile, OpenAIFileDeleted, OpenAIFileList
from app.datasets.routes import receive_dataset

router = APIRouter(route_class=Route, prefix="/v1/files", tags=["openai"])

_STATUS = {DatasetStatus.validating: "uploaded", DatasetStatus.ready: "processed", DatasetStatus.invalid: "error"}

_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(service.PURPOSES)},
                    },
                }
            }
        },
    }
}


def to_openai(d: Dataset) -> OpenAIFile:
    details = None
    if d.status == DatasetStatus.invalid and d.errors:
        first = d.errors[0]
        where = f"line {first['line']}: " if first.get("line") else ""
        details = f"{d.error_count} error(s); {where}{first['message']}"
    return OpenAIFile(
        id=d.id,
        bytes=d.bytes,
        created_at=int(d.created_at.timestamp()),
        filename=d.filename,
        purpose=d.purpose,
        status=_STATUS[d.status],
        status_details=details,
    )


def _get(session, user, file_id: str) -> Dataset:
    dataset = service.get_dataset(session, user, file_id)
    if dataset is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"No such File object: {file_id}")
    return dataset


@router.post("", response_model=OpenAIFile, openapi_extra=_BODY)
async def create_file(request: Request, user: CurrentUser) -> OpenAIFile:
    return to_openai(await receive_dataset(request, user, purpose_field=True))


@router.get("", response_model=OpenAIFileList)
def list_files(
    session: SessionDep,
    user: CurrentUser,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    after: str | None = None,
) -> OpenAIFileList:
    cursor = _get(session, user, after) if after else None
    rows, count = service.list_datasets(session, user, limit=limit, purpose=purpose, after=cursor)
    data = [to_openai(r) for r in rows]
    return OpenAIFileList(
        data=data,
        has_more=count > len(rows),
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/{file_id}", response_model=OpenAIFile)
def retrieve_file(file_id: str, session: SessionDep, user: CurrentUser) -> OpenAIFile:
    return to_openai(_get(session, user, file_id))


@router.get("/{file_id}/content")
def file_content(file_id: str, session: SessionDep, user: CurrentUser) -> FileResponse:
    dataset = _get(session, user, file_id)
    return FileResponse(service.file_path(dataset), filename=dataset.filename, media_type="application/octet-stream")


@router.delete("/{file_id}", response_model=OpenAIFileDeleted)
def delete_file(file_id: str, session: SessionDep, user: CurrentUser) -> OpenAIFileDeleted:
    dataset = _get(session, user, file_id)
    try:
        service.delete_dataset(session, dataset)
    except service.DatasetInUse as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    return OpenAIFileDeleted(id=file_id, deleted=True)
