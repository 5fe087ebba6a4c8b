"""The web application: dashboard pages, the native API, the OpenAI-compatible API, metrics."""

import gc
import math
from contextlib import asynccontextmanager
from pathlib import Path

import anyio.to_thread
from fastapi import FastAPI, HTTPException, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.middleware.sessions import SessionMiddleware

from app.arena import pages as arena_pages
from app.arena import routes as arena_routes
from app.artifacts import pages as artifact_pages
from app.artifacts import routes as artifact_routes
from app.auth import pages as auth_pages
from app.auth import routes as auth_routes
from app.auth.service import LimitReached
from app.base_models import routes as base_model_routes
from app.benchmarks import pages as benchmark_pages
from app.benchmarks import routes as benchmark_routes
from app.core import queue
from app.core.config import get_settings
from app.core.deps import LoginRequired
from app.core.errors import openai_error, validation_errors
from app.core.headers import SecurityHeaders, add_docs
from app.core.limits import BodyLimit
from app.core.metrics import MetricsMiddleware, metrics_endpoint
from app.core.templating import render
from app.datasets import openai_routes as dataset_openai_routes
from app.datasets import pages as dataset_pages
from app.datasets import routes as dataset_routes
from app.endpoints import gateway as endpoint_gateway
from app.endpoints import pages as endpoint_pages
from app.endpoints import routes as endpoint_routes
from app.evaluations import pages as evaluation_pages
from app.evaluations import routes as evaluation_routes
from app.pools import pages as pool_pages
from app.pools import routes as pool_routes
from app.runs import openai_routes as run_openai_routes
from app.runs import pages as run_pages
from app.runs import routes as run_routes
from app.web import pages as web_pages

ROOT = Path(__file__).resolve().parents[1]
# The modules whose `router` the app includes: the native API, the OpenAI-compatible API, the pages.
ROUTERS = (
    auth_routes,
    dataset_routes,
    dataset_openai_routes,
    pool_routes,
    base_model_routes,
    run_routes,
    run_openai_routes,
    artifact_routes,
    endpoint_routes,
    benchmark_routes,
    evaluation_routes,
    arena_routes,
    endpoint_gateway,
    auth_pages,
    dataset_pages,
    pool_pages,
    run_pages,
    artifact_pages,
    endpoint_pages,
    benchmark_pages,
    evaluation_pages,
    arena_pages,
    web_pages,
)


def create_app() -> FastAPI:
    settings = get_settings()

    @asynccontextmanager
    async def lifespan(_app):
        # Few threads: sync endpoints are short DB calls, and many threads only fight over the GIL.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.web_threads
        # Everything built at start-up lives for the whole process: keep the collector off it,
        # so a full collection does not walk it (tens of ms on every gen-2 pass).
        gc.freeze()
        yield
        await endpoint_gateway.shutdown()

    app = FastAPI(
        title="Tunedeck",
        version="0.1.0",
        lifespan=lifespan,
        description="LoRA fine-tuning and serving of open LLMs on TPU hosts",
        docs_url=None,  # added below, each with the Content-Security-Policy its page needs
        redoc_url=None,
    )
    app.add_middleware(
        SessionMiddleware,
        secret_key=settings.session_secret(),
        session_cookie="tunedeck_session",
        same_site="lax",
        https_only=settings.cookie_secure,
        max_age=14 * 24 * 3600,
    )
    app.add_middleware(MetricsMiddleware)
    app.add_middleware(endpoint_gateway.FastPath)  # the gateway's relayed chunks skip the others
    app.add_middleware(BodyLimit)  # no body is read past its cap, before authentication too
    app.add_middleware(SecurityHeaders)  # outermost: on every response, the others' refusals included
    app.mount("/static", StaticFiles(directory=ROOT / "static"), name="static")

    for module in ROUTERS:
        app.include_router(module.router)
    app.include_router(artifact_routes.worker_router)
    app.include_router(dataset_routes.worker_router)

    add_docs(app)

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict:
        return {"status": "ok"}

    app.add_route("/metrics", metrics_endpoint, include_in_schema=False)

    @app.exception_handler(LoginRequired)
    async def _login_required(request: Request, _: LoginRequired):
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"/login?next={target}", status_code=303)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        if request.url.path.startswith("/v1/"):
            response = openai_error(exc.status_code, str(exc.detail))
            response.headers.update(exc.headers or {})
            return response
        if _wants_html(request):
            return render(request, "error.html", status_code=exc.status_code, status=exc.status_code, detail=exc.detail)
        return await http_exception_handler(request, exc)

    @app.exception_handler(queue.BrokerUnavailable)
    async def _broker_down(request: Request, exc: queue.BrokerUnavailable):
        detail = f"{exc}; nothing was changed: try again once it is back"
        if request.url.path.startswith("/v1/"):
            return openai_error(503, detail)
        if _wants_html(request):
            return render(request, "error.html", status_code=503, status=503, detail=detail)
        return JSONResponse({"detail": detail}, 503)

    @app.exception_handler(LimitReached)
    async def _limit_reached(request: Request, exc: LimitReached):
        if request.url.path.startswith("/v1/"):
            return openai_error(429, str(exc))
        if _wants_html(request):
            return render(request, "error.html", status_code=429, status=429, detail=str(exc))
        return JSONResponse({"detail": str(exc)}, 429)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        if request.url.path.startswith("/v1/"):
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"][1:])
            return openai_error(422, f"{param}: {first['msg']}", param)
        # FastAPI's answer, quotes cut short, and a refused NaN or Infinity echoed as JSON can spell it
        return JSONResponse({"detail": _spelled(validation_errors(exc.errors()))}, 422)

    return app


def _spelled(value):
    """``value`` with its non-finite floats written the way JSON spells them ("Infinity", "NaN")."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: _spelled(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_spelled(v) for v in value]
    return value


def _wants_html(request: Request) -> bool:
    path = request.url.path
    return not path.startswith(("/api/", "/v1/", "/static/")) and "text/html" in request.headers.get("accept", "")
