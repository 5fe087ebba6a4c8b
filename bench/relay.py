"""The least a Python relay costs: a bare ASGI app under uvicorn (uvloop, httptools) that forwards
each request body to UPSTREAM with aiohttp (with UPSTREAM_API_KEY as its bearer, as the gateway sends
an endpoint's key) and streams the reply back chunk by chunk. No auth of its own, no routing, no
records. bench/gateway.py runs it beside the gateway, so that what the gateway adds can be told apart
from what any relay hop adds on the machine at hand.

    UPSTREAM=http://127.0.0.1:8100 UPSTREAM_API_KEY=KEY .venv/bin/python -m uvicorn bench.relay:app --port 8200
"""

import os

import aiohttp

UPSTREAM = os.environ.get("UPSTREAM", "")
HEADERS = {"content-type": "application/json"}
if os.environ.get("UPSTREAM_API_KEY"):
    HEADERS["authorization"] = f"Bearer {os.environ['UPSTREAM_API_KEY']}"
_client: aiohttp.ClientSession | None = None


async def app(scope, receive, send):
    global _client
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        if _client is not None:
            await _client.close()
        return await send({"type": "lifespan.shutdown.complete"})
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if _client is None:
        _client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    async with _client.request(scope["method"], UPSTREAM + scope["path"], data=body, headers=HEADERS) as r:
        headers = [(b"content-type", r.headers.get("content-type", "application/json").encode())]
        await send({"type": "http.response.start", "status": r.status, "headers": headers})
        async for chunk in r.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})
