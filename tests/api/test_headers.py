"""Every response carries the browser's security headers: a Content-Security-Policy that runs no
inline script, no framing, no referrer to other sites, no type sniffing."""

import base64
import hashlib
import re

import httpx

MB = 1024**2


def _policy(response: httpx.Response) -> dict[str, list[str]]:
    policy = response.headers["content-security-policy"]
    return {d.split()[0]: d.split()[1:] for d in (p.strip() for p in policy.split(";")) if d}


def test_every_response_carries_the_security_headers(server, api):
    anon = server.anonymous()
    api.get("/api/v1/users/me")  # the token is remembered: the gateway's fast path answers the next one
    responses = {
        "page": anon.get("/login"),
        "redirect": anon.get("/"),
        "health": anon.get("/healthz"),
        "static": anon.get("/static/app.css"),
        "401": anon.get("/api/v1/pools"),
        "api": api.get("/api/v1/users/me"),
        "openai": api.get("/v1/models"),
        "gateway": api.post("/v1/chat/completions", json={"model": "no-such-model", "messages": []}),
        "404": anon.get("/no-such-page"),
        "413": anon.post("/api/v1/runs", content=b"x" * (2 * MB), headers={"Content-Type": "application/json"}),
    }
    for what, r in responses.items():
        policy = _policy(r)
        assert policy["script-src"] == ["'self'"], what
        assert policy["frame-ancestors"] == ["'none'"] and policy["object-src"] == ["'none'"], what
        assert r.headers["x-frame-options"] == "DENY", what
        assert r.headers["referrer-policy"] == "same-origin", what
        assert r.headers["x-content-type-options"] == "nosniff", what
    assert responses["gateway"].status_code == 404 and responses["413"].status_code == 413

    # The API docs (Swagger UI) load from their CDN and run one inline script, allowed by its hash only.
    docs = anon.get("/docs")
    policy = _policy(docs)
    assert docs.status_code == 200 and "'unsafe-inline'" not in policy["script-src"]
    assert policy["frame-ancestors"] == ["'none'"]
    inline = re.findall(r"<script>(.*?)</script>", docs.text, re.S)
    assert inline, "the docs page's own script"
    for script in inline:
        digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in policy["script-src"]
