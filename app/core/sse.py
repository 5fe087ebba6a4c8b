"""Server-sent events that follow rows in the database.

Workers write state to the database; a watch polls it (cheaply, by a fingerprint) and sends an
event whenever the fingerprint changes. This works the same over SQLite and PostgreSQL and needs
nothing else running. Every RECHECK_SECONDS a watch asks again whether its caller's token or session
still holds (revoked, expired, user disabled, password changed): if not, it sends `unauthorized` with
the reason and ends.
"""

import asyncio
import time
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import Request
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from app.core.db import session_scope
from app.core.deps import refusal

POLL_SECONDS = 0.5
RECHECK_SECONDS = 3.0


def watch(
    request: Request, snapshot: Callable[[], tuple[Any, Any] | None], *, event: str = "update"
) -> EventSourceResponse:
    """Stream `snapshot()`'s payload each time its fingerprint changes.

    `snapshot` returns (fingerprint, payload) or None when the object is gone (ends the stream).
    """

    async def events():
        last = object()
        checked = time.monotonic()
        while not await request.is_disconnected():
            if time.monotonic() - checked >= RECHECK_SECONDS:
                checked = time.monotonic()
                if (reason := await run_in_threadpool(refusal, request)) is not None:
                    yield {"event": "unauthorized", "data": orjson.dumps({"detail": reason}).decode()}
                    return
            current = await run_in_threadpool(snapshot)
            if current is None:
                yield {"event": "deleted", "data": "{}"}
                return
            fingerprint, payload = current
            if fingerprint != last:
                last = fingerprint
                yield {"event": event, "data": orjson.dumps(payload).decode()}
            await asyncio.sleep(POLL_SECONDS)

    return EventSourceResponse(events(), ping=15)


def watch_body(request: Request, load: Callable[[Any], dict | None], fingerprint: Callable[[dict], Any]):
    """Stream the JSON body ``load(session)`` makes (each poll in a session of its own; None: the object
    is gone and the stream ends) whenever ``fingerprint(body)`` changes: a watched list or row."""

    def snapshot():
        with session_scope() as session:
            body = load(session)
        return None if body is None else (fingerprint(body), body)

    return watch(request, snapshot)
