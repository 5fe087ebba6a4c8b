"""The route class every router uses.

FastAPI runs a sync endpoint in a worker thread, then serializes its result in *another*
threadpool call, and only then runs dependency clean-up. A request whose endpoint has returned
would keep its pooled DB connection while it waits for that second thread; under load every
connection can end up held that way while every thread waits for a connection (a deadlock until
the pool's timeout). So a sync endpoint closes its session in its own thread as it returns.
Loaded objects stay readable (sessions do not expire on commit).

Text with a NUL character (``\\x00``) is refused here, for every route: PostgreSQL can neither store
nor compare it, so a path parameter, query parameter, JSON body string or form field holding one
would otherwise end in a server error wherever it reaches a query. The answer is a 422 naming it.
"""

import functools
import inspect
from typing import Any

from fastapi import Request, params
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from sqlmodel import Session

from app.core.schemas import NUL


def _closing_sessions(endpoint):
    @functools.wraps(endpoint)
    def run(*args, **kwargs):
        try:
            return endpoint(*args, **kwargs)
        finally:
            for value in kwargs.values():
                if isinstance(value, Session):
                    value.close()

    return run


def nul_at(value: Any, loc: tuple = ()) -> tuple | None:
    """Where a string (or object key) holding a NUL character is in a JSON value; None if nowhere.
    Walked without recursion: JSON can nest deeper than Python's stack."""
    stack = [(loc, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            if NUL in item:
                return where
        elif isinstance(item, dict):
            for key, child in item.items():
                if NUL in key:
                    return (*where, key)
                stack.append(((*where, key), child))
        elif isinstance(item, list):
            stack.extend(((*where, i), child) for i, child in enumerate(item))
    return None


async def _request_nul(request: Request, body: str | None) -> tuple | None:
    """Where a NUL character is in the request's path or query parameters, or its JSON or form body."""
    for where, values in (("path", request.path_params.items()), ("query", request.query_params.multi_items())):
        for name, value in values:
            if isinstance(value, str) and NUL in value:
                return (where, name)
    if body == "form":
        fields = [(name, value) for name, value in (await request.form()).multi_items() if isinstance(value, str)]
        return next((("body", name) for name, value in fields if NUL in value), None)
    if body == "json":
        try:
            parsed = await request.json()  # kept by the request: FastAPI's own parse reuses it
        except Exception:  # noqa: BLE001 - not JSON, nested deeper than the parser goes, or cut off: FastAPI answers it
            return None
        return nul_at(parsed, ("body",))
    return None


class Route(APIRoute):
    def __init__(self, path: str, endpoint, **kwargs) -> None:
        if not inspect.iscoroutinefunction(endpoint):
            endpoint = _closing_sessions(endpoint)
        super().__init__(path, endpoint, **kwargs)

    def get_route_handler(self):
        handler = super().get_route_handler()
        field = self.body_field
        body = None if field is None else "form" if isinstance(field.field_info, params.Form) else "json"

        async def refusing_nul(request: Request):
            loc = await _request_nul(request, body)
            if loc is not None:
                raise RequestValidationError(
                    [{"type": "string_nul", "loc": loc, "msg": "must not contain a NUL character (\\u0000)"}]
                )
            return await handler(request)

        return refusing_nul
