"""The gateway: Tunedeck's own `/v1/models`, `/v1/chat/completions` and `/v1/completions`,
authenticated with Tunedeck tokens and routed by `model` to the caller's ready endpoint serving it.

Replies stream through as the model server sends them, chunk by chunk, never buffered. Each request
becomes a sample (time to first token, output tokens, duration, errors) once its response is done:
the endpoint's passive metrics, from real traffic.
"""

import re
import time

import httpx
import orjson
from fastapi import APIRouter, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from app.auth.models import User
from app.core.db import session_scope
from app.core.deps import CurrentUser, SessionDep
from app.core.routing import Route
from app.endpoints import service

router = APIRouter(route_class=Route, prefix="/v1", tags=["openai"])

# A chunk carrying generated text: chat `"content":"x` or completion `"text":"x` (not an empty string).
_TOKEN = re.compile(rb'"(?:content|text)":\s*"(?!")')
_USAGE_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_client: httpx.AsyncClient | None = None


def _upstream() -> httpx.AsyncClient:
    global _client
    if _client is None:
        # No read timeout: a long reply streams for as long as it takes.
        _client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None), limits=httpx.Limits(max_connections=1000))
    return _client


@router.get("/models")
def list_models(session: SessionDep, user: CurrentUser) -> dict:
    """The models the caller can call: those of their ready endpoints."""
    seen = {}
    for e in service.ready_endpoints(session, user):
        seen.setdefault(
            e.model, {"id": e.model, "object": "model", "created": int(e.ready_at.timestamp()), "owned_by": "tunedeck"}
        )
    return {"object": "list", "data": list(seen.values())}


def _serving(user: User, model: str):
    with session_scope() as session:
        return service.serving(session, user, model)


class _Stats:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ttft: float | None = None
        self.token_events = 0
        self.usage_tokens: int | None = None
        self.error: str | None = None
        self.end: float | None = None


async def _proxy(path: str, request: Request, user: User) -> StreamingResponse:
    body = await request.body()
    try:
        model = orjson.loads(body).get("model")
    except (orjson.JSONDecodeError, AttributeError):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "the request body must be a JSON object") from None
    if not isinstance(model, str) or not model:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "model: a model id is required")
    endpoint = await run_in_threadpool(_serving, user, model)
    if endpoint is None:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"The model `{model}` is not deployed: deploy its artifact (POST /api/v1/endpoints) and wait for ready",
        )
    stats = _Stats()
    client = _upstream()
    upstream = client.build_request(
        "POST", endpoint.url + path, content=body, headers={"content-type": "application/json"}
    )
    try:
        response = await client.send(upstream, stream=True)
    except httpx.HTTPError as exc:
        stats.error = f"the model server is unreachable: {exc}"
        await run_in_threadpool(_record, endpoint.id, stats, 502)
        raise HTTPException(status.HTTP_502_BAD_GATEWAY, stats.error) from exc

    async def relay():
        try:
            async for chunk in response.aiter_raw():
                if _TOKEN.search(chunk):
                    if stats.ttft is None:
                        stats.ttft = time.perf_counter() - stats.start
                    stats.token_events += 1
                if m := _USAGE_TOKENS.search(chunk):
                    stats.usage_tokens = int(m[1])
                yield chunk
        except httpx.HTTPError as exc:
            stats.error = f"the model server's reply broke off: {exc}"
        finally:
            stats.end = time.perf_counter()
            await response.aclose()

    return StreamingResponse(
        relay(),
        status_code=response.status_code,
        media_type=response.headers.get("content-type"),
        background=BackgroundTask(_record, endpoint.id, stats, response.status_code),
    )


def _record(endpoint_id: str, stats: _Stats, status_code: int) -> None:
    end = stats.end or time.perf_counter()
    tokens = stats.usage_tokens if stats.usage_tokens is not None else stats.token_events
    error = stats.error or (f"HTTP {status_code}" if status_code >= 400 else None)
    with session_scope() as session:
        service.record_sample(
            session,
            endpoint_id,
            "gateway",
            ttft_s=stats.ttft,
            duration_s=end - stats.start,
            output_tokens=tokens,
            status_code=status_code,
            error=error,
        )


@router.post("/chat/completions")
async def chat_completions(request: Request, user: CurrentUser) -> StreamingResponse:
    """OpenAI's chat completions, served by the endpoint that serves `model` (streaming or not)."""
    return await _proxy("/v1/chat/completions", request, user)


@router.post("/completions")
async def completions(request: Request, user: CurrentUser) -> StreamingResponse:
    """OpenAI's (legacy) completions, served by the endpoint that serves `model`."""
    return await _proxy("/v1/completions", request, user)
