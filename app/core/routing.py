"""The route class every router uses.

FastAPI runs a sync endpoint in a worker thread, then serializes its result in *another*
threadpool call, and only then runs dependency clean-up. A request whose endpoint has returned
would keep its pooled DB connection while it waits for that second thread; under load every
connection can end up held that way while every thread waits for a connection (a deadlock until
the pool's timeout). So a sync endpoint closes its session in its own thread as it returns.
Loaded objects stay readable (sessions do not expire on commit).
"""

import functools
import inspect

from fastapi.routing import APIRoute
from sqlmodel import Session


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


class Route(APIRoute):
    def __init__(self, path: str, endpoint, **kwargs) -> None:
        if not inspect.iscoroutinefunction(endpoint):
            endpoint = _closing_sessions(endpoint)
        super().__init__(path, endpoint, **kwargs)
