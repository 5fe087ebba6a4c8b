"""Artifacts API: /api/v1/artifacts (merged checkpoints and PEFT adapters of runs)."""

import posixpath
import re
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Request, status
from fastapi.responses import FileResponse, Response, StreamingResponse

from app.artifacts import service
from app.artifacts.models import Artifact, ArtifactCreate, ArtifactPublic, ArtifactsPublic
from app.core import errors, security
from app.core.deps import CurrentUser, SessionDep
from app.core.routing import Route
from app.core.schemas import Offset
from app.core.sse import watch_body

CHUNK = 1 << 20

router = APIRouter(route_class=Route, prefix="/api/v1/artifacts", tags=["artifacts"])


def _get(session, user, artifact_id: str) -> Artifact:
    return errors.found(service.get(session, user, artifact_id), "artifact", artifact_id)


def _fingerprint(a: dict) -> tuple:
    return a["id"], a["status"], a["bytes_done"], a["bytes_total"]


@router.post("", response_model=ArtifactPublic, status_code=status.HTTP_201_CREATED)
def create_artifact(data: ArtifactCreate, session: SessionDep, user: CurrentUser) -> ArtifactPublic:
    """Merge a run checkpoint into its base (`kind: merged`) or export it as a PEFT adapter (`adapter`)."""
    try:
        return service.to_public(service.create(session, user, data))
    except service.ArtifactError as exc:
        raise errors.answer(exc) from exc


@router.get("", response_model=ArtifactsPublic)
def list_artifacts(
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    run_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
    watch_: Annotated[bool, Query(alias="watch")] = False,
):
    """The user's artifacts, newest first; `?run_id=` filters; `?watch=true` streams the list (SSE)."""

    def listed(s) -> dict:
        rows = service.list_artifacts(s, user, run_id=run_id, limit=limit, offset=offset)
        return ArtifactsPublic(data=[service.to_public(a) for a in rows], count=len(rows)).model_dump(mode="json")

    if not watch_:
        return listed(session)

    return watch_body(request, listed, lambda body: [_fingerprint(a) for a in body["data"]])


@router.get("/{artifact_id}", response_model=ArtifactPublic)
def get_artifact(
    artifact_id: str,
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    watch_: Annotated[bool, Query(alias="watch")] = False,
):
    artifact = _get(session, user, artifact_id)
    if not watch_:
        return service.to_public(artifact)

    def load(s):
        current = service.get(s, user, artifact_id)
        return None if current is None else service.to_public(current).model_dump(mode="json")

    return watch_body(request, load, _fingerprint)


@router.get("/{artifact_id}/files/{name:path}")
def download_file(artifact_id: str, name: str, request: Request, session: SessionDep, user: CurrentUser) -> Response:
    """One file of a succeeded artifact, streamed; HTTP range requests resume large downloads."""
    return _file(_get(session, user, artifact_id), name, request)


# Workers on other hosts copy an artifact's files from here (worker.model_cache), with a credential for that
# artifact signed with the deployment's shared secret instead of a user's token. Not part of the API.
worker_router = APIRouter(route_class=Route, prefix="/internal/artifacts", include_in_schema=False)


@worker_router.get("/{artifact_id}/files/{name:path}")
def worker_download_file(
    artifact_id: str,
    name: str,
    request: Request,
    session: SessionDep,
    token: Annotated[str, Header(alias=security.WORKER_TOKEN_HEADER, max_length=500)] = "",
) -> Response:
    if not security.worker_token_allows(token, artifact_id):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"no worker credential for artifact {artifact_id} (is TUNEDECK_SECRET_KEY the same on every host?)",
        )
    artifact = errors.found(session.get(Artifact, artifact_id), "artifact", artifact_id)
    return _file(artifact, name, request)


def _file(artifact: Artifact, name: str, request: Request) -> Response:
    found = service.open_file(artifact, name)
    if found is None or not found[0].exists(found[1]):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"artifact {artifact.id} has no file {name}")
    fs, path, size = found
    filename = posixpath.basename(name)
    if "://" not in artifact.path:  # the data dir: the OS sends the file
        return FileResponse(path, filename=filename, media_type="application/octet-stream")
    return _ranged(fs, path, size, filename, request.headers.get("range"))


def _ranged(fs, path: str, size: int, filename: str, range_header: str | None) -> Response:
    """A file of a remote store (gs://...), streamed through, honouring one byte range."""
    start, end, code = 0, size - 1, status.HTTP_200_OK
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", (range_header or "").strip())
    if m and (m[1] or m[2]):
        start, end = (int(m[1]), int(m[2]) if m[2] else size - 1) if m[1] else (max(0, size - int(m[2])), size - 1)
        end = min(end, size - 1)
        if start > end:
            return Response(
                status_code=status.HTTP_416_RANGE_NOT_SATISFIABLE, headers={"content-range": f"bytes */{size}"}
            )
        code = status.HTTP_206_PARTIAL_CONTENT

    def chunks():
        with fs.open(path, "rb") as f:
            f.seek(start)
            left = end - start + 1
            while left > 0 and (data := f.read(min(CHUNK, left))):
                left -= len(data)
                yield data

    headers = {
        "accept-ranges": "bytes",
        "content-length": str(end - start + 1),
        "content-disposition": f'attachment; filename="{filename}"',
    }
    if code == status.HTTP_206_PARTIAL_CONTENT:
        headers["content-range"] = f"bytes {start}-{end}/{size}"
    return StreamingResponse(chunks(), status_code=code, headers=headers, media_type="application/octet-stream")


@router.delete("/{artifact_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_artifact(artifact_id: str, session: SessionDep, user: CurrentUser) -> None:
    try:
        service.delete(session, _get(session, user, artifact_id))
    except service.ArtifactError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
