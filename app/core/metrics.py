"""Prometheus metrics: HTTP requests and latency, queue depth, workers online."""

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from sqlmodel import select
from starlette.requests import Request
from starlette.responses import Response

from app.core import queue
from app.core.db import session_scope

registry = CollectorRegistry()
REQUESTS = Counter("tunedeck_http_requests_total", "HTTP requests", ["method", "route", "status"], registry=registry)
LATENCY = Histogram(
    "tunedeck_http_request_duration_seconds",
    "HTTP request latency",
    ["method", "route"],
    registry=registry,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)


class _StateCollector:
    """Read on each scrape: the broker's queue depths and the workers whose heartbeat is fresh."""

    def collect(self):
        from app.pools import service as pools
        from app.pools.models import Pool

        with session_scope() as session:
            names = [p for p in session.exec(select(Pool.name))]
            online = pools.workers_online(session)
        workers = GaugeMetricFamily("tunedeck_workers_online", "Workers with a fresh heartbeat", labels=["pool"])
        for name in sorted(set(names) | set(online)):
            workers.add_metric([name], online.get(name, 0))
        yield workers
        depth = GaugeMetricFamily("tunedeck_queue_depth", "Tasks waiting in the broker", labels=["queue"])
        for name, n in queue.queue_depths([queue.GENERAL_QUEUE, *names]).items():
            depth.add_metric([name], n)
        yield depth


registry.register(_StateCollector())


class MetricsMiddleware:
    """Pure ASGI, so it adds next to nothing to each request. Labels use the route template."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status_holder = [500]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status_holder[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or ("static" if scope["path"].startswith("/static/") else "unmatched")
            observe(scope["method"], path, status_holder[0], time.perf_counter() - start)


def observe(method: str, route: str, status_code: int, seconds: float) -> None:
    """One served request, counted and timed under its route's template."""
    REQUESTS.labels(method, route, str(status_code)).inc()
    LATENCY.labels(method, route).observe(seconds)


def metrics_endpoint(_: Request) -> Response:
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
