"""The gateway: Tunedeck's own `/v1/models`, `/v1/chat/completions` and `/v1/completions`,
authenticated with Tunedeck tokens and routed by `model` to the caller's ready endpoint serving it.

Replies stream through as the model server sends them, chunk by chunk, never buffered. Each request
becomes a sample (time to first token, output tokens, duration, errors) once its response is done:
the endpoint's passive metrics, from real traffic.

What the gateway adds to time to first token is kept under 2 ms (bench/gateway.py): a token seen in
the last seconds needs no query (auth.service.recent_user); a model's endpoint is remembered for
TUNEDECK_GATEWAY_ROUTE_SECONDS, and looked up again at once when its server does not answer; the
upstream client is aiohttp's, which takes about half the time per request of httpx's.
"""

import asyncio
import logging
import re
import time

import aiohttp
import orjson
from fastapi import APIRouter, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from app.auth.models import User
from app.core.config import get_settings
from app.core.db import session_scope, utcnow
from app.core.deps import CurrentUser, SessionDep
from app.core.routing import Route
from app.endpoints import service
from app.endpoints.models import Endpoint

log = logging.getLogger(__name__)
router = APIRouter(route_class=Route, prefix="/v1", tags=["openai"])

# A chunk carrying generated text: chat `"content":"x` or completion `"text":"x` (not an empty string).
_TOKEN = re.compile(rb'"(?:content|text)":\s*"(?!")')
_USAGE_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_routes: dict[tuple[int, str], tuple[float, Endpoint]] = {}  # (user id, model) -> (until, endpoint)
_client: aiohttp.ClientSession | None = None


def _upstream() -> aiohttp.ClientSession:
    global _client
    if _client is None:
        # No read timeout: a long reply streams for as long as it takes.
        timeout = aiohttp.ClientTimeout(total=None, connect=10.0)
        _client = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1000))
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


async def _serving(user: User, model: str, *, fresh: bool = False) -> Endpoint | None:
    key = (user.id, model)
    hit = _routes.get(key)
    if hit is not None and hit[0] > time.monotonic() and not fresh:
        return hit[1]

    def look_up():
        with session_scope() as session:
            return service.serving(session, user, model)

    endpoint = await run_in_threadpool(look_up)
    if endpoint is None:
        _routes.pop(key, None)
    else:
        if len(_routes) > 1000:
            _routes.clear()
        _routes[key] = (time.monotonic() + get_settings().gateway_route_seconds, endpoint)
    return endpoint


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
    stats = _Stats()
    endpoint = await _serving(user, model)
    for attempt in (1, 2):
        if endpoint is None:
            raise HTTPException(
                status.HTTP_404_NOT_FOUND,
                f"The model `{model}` is not deployed: deploy its artifact (POST /api/v1/endpoints) and wait for ready",
            )
        try:
            response = await _upstream().post(
                endpoint.url + path, data=body, headers={"content-type": "application/json"}
            )
            break
        except aiohttp.ClientError as exc:
            if attempt == 1:  # the remembered endpoint may have gone, or restarted: ask the database again
                endpoint = await _serving(user, model, fresh=True)
                continue
            stats.error = f"the model server is unreachable: {exc}"
            await _record(endpoint.id, stats, 502)
            raise HTTPException(status.HTTP_502_BAD_GATEWAY, stats.error) from exc

    async def relay():
        try:
            async for chunk in response.content.iter_any():
                if _TOKEN.search(chunk):
                    if stats.ttft is None:
                        stats.ttft = time.perf_counter() - stats.start
                    stats.token_events += 1
                if m := _USAGE_TOKENS.search(chunk):
                    stats.usage_tokens = int(m[1])
                yield chunk
        except aiohttp.ClientError as exc:
            stats.error = f"the model server's reply broke off: {exc}"
        finally:
            stats.end = time.perf_counter()
            response.release()

    return StreamingResponse(
        relay(),
        status_code=response.status,
        media_type=response.headers.get("content-type"),
        background=BackgroundTask(_record, endpoint.id, stats, response.status),
    )


SAMPLE_FLUSH_S = 0.5
_samples: list[dict] = []  # finished requests' samples, written together every SAMPLE_FLUSH_S
_flushes: set[asyncio.Task] = set()


async def _record(endpoint_id: str, stats: _Stats, status_code: int) -> None:
    """The request's sample, written with the others that end within SAMPLE_FLUSH_S: one insert per
    batch, in a thread, instead of a transaction per request (a sixth of the gateway's CPU otherwise)."""
    end = stats.end or time.perf_counter()
    _samples.append(
        {
            "endpoint_id": endpoint_id,
            "at": utcnow(),
            "source": "gateway",
            "ttft_s": stats.ttft,
            "duration_s": end - stats.start,
            "output_tokens": stats.usage_tokens if stats.usage_tokens is not None else stats.token_events,
            "status_code": status_code,
            "error": stats.error or (f"HTTP {status_code}" if status_code >= 400 else None),
        }
    )
    if len(_samples) == 1:
        asyncio.get_running_loop().call_later(SAMPLE_FLUSH_S, _start_flush)


def _start_flush() -> None:
    task = asyncio.ensure_future(_flush_samples())
    _flushes.add(task)  # held until done (the loop keeps only a weak reference)
    task.add_done_callback(_flushes.discard)


async def _flush_samples() -> None:
    batch = _samples[:]
    del _samples[: len(batch)]
    if batch:
        try:
            await run_in_threadpool(_write_samples, batch)
        except Exception:  # noqa: BLE001 - metrics; the requests themselves were served
            log.exception("could not record %d gateway samples", len(batch))


def _write_samples(batch: list[dict]) -> None:
    with session_scope() as session:
        service.record_samples(session, batch)


async def shutdown() -> None:
    """Write the samples still pending and close the upstream client (the web process is stopping)."""
    global _client
    await _flush_samples()
    if _client is not None:
        await _client.close()
        _client = None


@router.post("/chat/completions")
async def chat_completions(request: Request, user: CurrentUser) -> StreamingResponse:
    """OpenAI's chat completions, served by the endpoint that serves `model` (streaming or not)."""
    return await _proxy("/v1/chat/completions", request, user)


@router.post("/completions")
async def completions(request: Request, user: CurrentUser) -> StreamingResponse:
    """OpenAI's (legacy) completions, served by the endpoint that serves `model`."""
    return await _proxy("/v1/completions", request, user)
