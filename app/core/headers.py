"""Security headers on every response, and the API docs pages under a policy of their own.

The dashboard runs no inline script (templates/ hold none; JSON data blocks are not run), so the
Content-Security-Policy allows scripts from this origin only. Inline `style=` attributes are allowed
('unsafe-inline' in style-src): a style cannot run code, and the templates and scripts set a few.
The docs pages (Swagger UI, ReDoc) load from their CDN and Swagger UI runs one inline script, allowed
by its hash alone.
"""

import base64
import hashlib
import re

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_COMMON = ("object-src 'none'", "base-uri 'none'", "form-action 'self'", "frame-ancestors 'none'")

POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",  # data: for the favicon and CSS icons
        "connect-src 'self'",
        *_COMMON,
    )
)

HEADERS = (
    (b"content-security-policy", POLICY.encode()),
    (b"x-frame-options", b"DENY"),  # what frame-ancestors says, for browsers that predate it
    (b"referrer-policy", b"same-origin"),
    (b"x-content-type-options", b"nosniff"),
)


class SecurityHeaders:
    """Pure ASGI middleware, outermost: adds HEADERS to every response that does not set its own."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                present = {name.lower() for name, _ in headers}
                headers.extend(h for h in HEADERS if h[0] not in present)
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)


CDN = "https://cdn.jsdelivr.net"


def _docs_policy(html: str) -> str:
    hashes = [
        "'sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode() + "'"
        for script in re.findall(r"<script>(.*?)</script>", html, re.S)
    ]
    return "; ".join(
        (
            "default-src 'self'",
            " ".join(("script-src 'self'", CDN, *hashes)),
            f"style-src 'self' 'unsafe-inline' {CDN} https://fonts.googleapis.com",
            "font-src 'self' https://fonts.gstatic.com",
            f"img-src 'self' data: {CDN} https://fastapi.tiangolo.com",
            "worker-src 'self' blob:",  # ReDoc
            "connect-src 'self'",
            *_COMMON,
        )
    )


def add_docs(app: FastAPI) -> None:
    """/docs and /redoc as FastAPI makes them (create the app with docs_url=None, redoc_url=None), each
    answered with the policy its page needs."""
    openapi_url = app.openapi_url or "/openapi.json"
    pages = {
        "/docs": get_swagger_ui_html(openapi_url=openapi_url, title=f"{app.title} - Swagger UI").body,
        "/redoc": get_redoc_html(openapi_url=openapi_url, title=f"{app.title} - ReDoc").body,
    }
    for path, html in pages.items():
        app.add_api_route(path, _page(bytes(html).decode()), methods=["GET"], include_in_schema=False)


def _page(html: str):
    headers = {"Content-Security-Policy": _docs_policy(html)}

    async def page() -> HTMLResponse:
        return HTMLResponse(html, headers=headers)

    return page
