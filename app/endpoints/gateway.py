"""The gateway: Tunedeck's own `/v1/models`, `/v1/chat/completions` and `/v1/completions`,
authenticated with Tunedeck tokens and routed by `model` to the caller's ready endpoint serving it.

It calls the model server with the endpoint's key: each model server answers only the bearer of its
own key (worker/serve/server.py; vLLM's VLLM_API_KEY), and one that refuses it (its port now another's,
or a restart gave it a new key) makes the gateway look the model's endpoint up again. Replies stream
through as the model server sends them, chunk by chunk, never buffered. Each request becomes a sample
(time to first token, output tokens, duration, errors) once its response is done: the endpoint's
passive metrics, from real traffic.

What the gateway adds to time to first token is kept near a millisecond, and its CPU per request
near that of a bare uvicorn + aiohttp relay (bench/gateway.py): a token seen in the last seconds needs
no query (auth.service.recent_user), and its requests take `FastPath`, which skips routing and the
other middleware; a model's endpoint is remembered for TUNEDECK_GATEWAY_ROUTE_SECONDS, and looked up
again at once when its server does not answer; the upstream client is aiohttp's, which takes about
half the time per request of httpx's.
"""

import asyncio
import logging
import re
import time

import aiohttp
import orjson
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from app.auth.models import User
from app.auth.service import recent_user
from app.core import metrics
from app.core.config import get_settings
from app.core.db import session_scope, utcnow
from app.core.deps import CurrentUser, SessionDep
from app.core.errors import openai_error
from app.core.routing import Route
from app.core.schemas import NUL
from app.core.security import bearer_secret
from app.endpoints import service
from app.endpoints.models import Endpoint

log = logging.getLogger(__name__)
router = APIRouter(route_class=Route, prefix="/v1", tags=["openai"])

# A chunk carrying generated text: chat `"content":"x` (or a thought's `"reasoning_content":"x`) or
# completion `"text":"x` (not an empty string).
_TOKEN = re.compile(rb'"(?:content|reasoning_content|text)":\s*"(?!")')
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
        assert e.ready_at is not None, "a ready endpoint has its ready_at"
        seen.setdefault(
            e.model, {"id": e.model, "object": "model", "created": int(e.ready_at.timestamp()), "owned_by": "tunedeck"}
        )
    return {"object": "list", "data": list(seen.values())}


async def _serving(user: User, model: str, *, fresh: bool = False) -> Endpoint | None:
    assert user.id is not None, "the caller is a saved user"
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


async def relay(path: str, body: bytes, user: User, receive: Receive, send: Send) -> int:
    """Forward an OpenAI request to the endpoint serving its `model`, and stream the reply to `send`
    as it comes, chunk by chunk. Answers the reply's status code. A client that goes away closes the
    upstream connection, which stops the generation."""
    stats = _Stats()
    try:
        model = orjson.loads(body).get("model")
    except (orjson.JSONDecodeError, AttributeError):
        return await _refuse(400, "the request body must be a JSON object", receive, send)
    if not isinstance(model, str) or not model:
        return await _refuse(400, "model: a model id is required", receive, send)
    if NUL in model:  # PostgreSQL could not look it up
        return await _refuse(400, "model: must not contain a NUL character (\\u0000)", receive, send)
    endpoint = await _serving(user, model)
    for attempt in (1, 2):
        if endpoint is None:
            return await _refuse(404, f"The model `{model}` is not deployed: {_DEPLOY_IT}", receive, send)
        assert endpoint.url is not None, "a ready endpoint has its url"
        try:
            response = await _upstream().post(endpoint.url + path, data=body, headers=_headers(endpoint))
        except aiohttp.ClientError as exc:
            if attempt == 1:  # the remembered endpoint may have gone, or restarted: ask the database again
                endpoint = await _serving(user, model, fresh=True)
                continue
            stats.error = f"the model server is unreachable: {exc}"
            _record(endpoint.id, stats, 502)
            return await _refuse(502, stats.error, receive, send)
        if response.status != 401:
            break
        # Not this endpoint's model server any more (another took its port, or it restarted with a new key)
        response.release()
        if attempt == 1:
            endpoint = await _serving(user, model, fresh=True)
            continue
        stats.error = "the model server refused the endpoint's key"
        _record(endpoint.id, stats, 502)
        return await _refuse(502, stats.error, receive, send)
    else:  # each attempt above breaks or returns
        raise AssertionError("unreachable")

    finished = False

    def client_left(_) -> None:
        if not finished:
            response.close()

    # Resolves with `http.disconnect` once the client goes away (or once the response is complete).
    left = asyncio.ensure_future(receive())
    left.add_done_callback(client_left)
    headers = [(b"content-type", response.headers.get("content-type", "application/json").encode())]
    try:
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        async for chunk in response.content.iter_any():
            if _TOKEN.search(chunk):
                if stats.ttft is None:
                    stats.ttft = time.perf_counter() - stats.start
                stats.token_events += 1
            if m := _USAGE_TOKENS.search(chunk):
                stats.usage_tokens = int(m[1])
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finished = True
        await send({"type": "http.response.body", "body": b""})
    except aiohttp.ClientError as exc:
        if not left.done():
            stats.error = f"the model server's reply broke off: {exc}"
    finally:
        finished = True
        stats.end = time.perf_counter()
        response.release()
        left.cancel()
        _record(endpoint.id, stats, response.status)
    return response.status


def _headers(endpoint: Endpoint) -> dict[str, str]:
    if endpoint.api_key is None:  # started before model servers had keys
        return {"content-type": "application/json"}
    return {"content-type": "application/json", "authorization": f"Bearer {endpoint.api_key}"}


_DEPLOY_IT = "deploy its artifact (POST /api/v1/endpoints) and wait for ready"


async def _refuse(status_code: int, message: str, receive: Receive, send: Send) -> int:
    await openai_error(status_code, message)({"type": "http"}, receive, send)
    return status_code


class Relay(Response):
    """The routes' answer: `relay` run with the ASGI `send` of the response."""

    def __init__(self, path: str, request_body: bytes, user: User) -> None:  # no body of its own to render
        self.background = None
        self.path, self.request_body, self.user = path, request_body, user

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await relay(self.path, self.request_body, self.user, receive, send)


class FastPath:
    """The gateway's hot path, as pure ASGI middleware outside the others: a request with an API token
    that passed in the last seconds is relayed without routing, dependencies or the other middleware's
    wrapping of every chunk (about half the gateway's CPU per request, bench/gateway.py). Anything else
    (a cookie session, a token not seen lately, no token) goes on to the routes below, which answer
    the same through `Relay`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        user = None
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in _PATHS:
            user = _token_user(scope["headers"])
        if user is None:
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status_code = await relay(scope["path"], bytes(body), user, receive, send)
        metrics.observe("POST", scope["path"], status_code, time.perf_counter() - start)


_PATHS = {"/v1/chat/completions", "/v1/completions"}


def _token_user(headers: list[tuple[bytes, bytes]]) -> User | None:
    for name, value in headers:
        if name == b"authorization":
            secret = bearer_secret(value.decode("latin-1"))
            return recent_user(secret) if secret else None
    return None


SAMPLE_FLUSH_S = 0.5
_samples: list[dict] = []  # finished requests' samples, written together every SAMPLE_FLUSH_S
_flushes: set[asyncio.Task] = set()


def _record(endpoint_id: str, stats: _Stats, status_code: int) -> None:
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
async def chat_completions(request: Request, user: CurrentUser) -> Relay:
    """OpenAI's chat completions, served by the endpoint that serves `model` (streaming or not)."""
    return Relay("/v1/chat/completions", await request.body(), user)


@router.post("/completions")
async def completions(request: Request, user: CurrentUser) -> Relay:
    """OpenAI's (legacy) completions, served by the endpoint that serves `model`."""
    return Relay("/v1/completions", await request.body(), user)
