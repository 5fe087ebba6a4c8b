"""Request bodies have a size cap, checked before anything reads them: FastAPI reads and parses a
whole JSON body before the route's token dependency runs, so without a cap anyone could make the web
process hold any amount of memory. Uploads are exempt (they stream to disk under `max_upload_bytes`,
after authentication); the gateway's OpenAI routes have a cap of their own (long prompts)."""

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.config import get_settings
from app.core.errors import openai_error

UPLOADS = {"/api/v1/datasets", "/v1/files"}  # multipart uploads, streamed to disk by app.core.uploads
GATEWAY = {"/v1/chat/completions", "/v1/completions"}


class BodyLimit:
    """Pure ASGI middleware, outermost: a body declared larger than its route's cap is refused with
    413 before a byte of it is read; one sent without a length (chunked) is counted as it arrives and
    refused as soon as it passes the cap."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        settings = get_settings()
        self.json_cap, self.gateway_cap = settings.max_body_bytes, settings.gateway_max_body_bytes

    def cap(self, scope: Scope) -> int | None:
        path = scope["path"]
        if scope["method"] == "POST" and path in UPLOADS:
            return None
        return self.gateway_cap if path in GATEWAY else self.json_cap

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cap = self.cap(scope) if scope["type"] == "http" else None
        if cap is None:
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await _refuse(scope, receive, send, 400, "Content-Length is not a number")
                if declared > cap:
                    return await _refuse(scope, receive, send, 413, _message(cap))
        received, started, refused = 0, False, False

        async def capped_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:  # answered here, and to the route it looks like the client left
                    refused = True
                    if not started:
                        await _refuse(scope, receive, send, 413, _message(cap))
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if not refused:
                started = started or message["type"] == "http.response.start"
                await send(message)

        try:
            await self.app(scope, capped_receive, tracked_send)
        except Exception:
            if not refused:  # what the route made of the "disconnect" is of no interest
                raise


def _message(cap: int) -> str:
    return f"the request body is larger than this route accepts ({cap:,} bytes)"


async def _refuse(scope: Scope, receive: Receive, send: Send, status_code: int, message: str) -> None:
    """The error in the shape of the API it was sent to; the connection is closed after it, so the
    rest of the body is never read."""
    if scope["path"].startswith("/v1/"):
        response = openai_error(status_code, message)
    else:
        response = JSONResponse({"detail": message}, status_code)
    response.headers["connection"] = "close"
    await response(scope, receive, send)
