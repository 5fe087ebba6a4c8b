"""Every API route needs a token; users only see their own objects."""

import re

import httpx
import pytest

from tests.conftest import make_user, upload, wait_dataset

CHAT = b'{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"hello"}]}\n'


def _api_operations(schema: dict):
    for path, item in schema["paths"].items():
        for method in item:
            if method in {"get", "post", "put", "patch", "delete"}:
                yield method.upper(), re.sub(r"\{[^}]+\}", "x1", path)


def test_every_api_route_rejects_missing_and_bad_tokens(server):
    anon = server.anonymous()
    schema = anon.get("/openapi.json").json()
    operations = list(_api_operations(schema))
    assert len(operations) >= 15, operations
    paths = {p for _, p in operations}
    assert {"/api/v1/datasets", "/v1/files", "/api/v1/pools", "/api/v1/tokens"} <= paths
    for method, path in operations:
        r = anon.request(method, path)
        assert r.status_code == 401, (method, path, r.status_code, r.text)
        assert r.headers.get("www-authenticate") == "Bearer"
        bad = anon.request(method, path, headers={"Authorization": "Bearer td_not_a_token"})
        assert bad.status_code == 401, (method, path, bad.status_code)
        odd = anon.request(method, path, headers={"Authorization": "Basic YWRtaW46eA=="})
        assert odd.status_code == 401 and "must be 'Bearer <token>'" in odd.text, (method, path, odd.text)


def test_openai_routes_answer_in_openai_error_shape(server):
    r = server.anonymous().get("/v1/files")
    assert r.status_code == 401
    assert "token" in r.json()["error"]["message"]


def test_another_users_dataset_is_not_found(server, api):
    _, _, token_b = make_user(server)
    b = server.client(token_b)
    mine = upload(api, "a.jsonl", CHAT).json()
    wait_dataset(server, api, mine["id"])
    for method, path in [
        ("GET", f"/api/v1/datasets/{mine['id']}"),
        ("GET", f"/api/v1/datasets/{mine['id']}/content"),
        ("DELETE", f"/api/v1/datasets/{mine['id']}"),
        ("GET", f"/v1/files/{mine['id']}"),
        ("GET", f"/v1/files/{mine['id']}/content"),
        ("DELETE", f"/v1/files/{mine['id']}"),
    ]:
        assert b.request(method, path).status_code == 404, (method, path)
    assert mine["id"] not in [d["id"] for d in b.get("/api/v1/datasets").json()["data"]]
    assert api.get(f"/api/v1/datasets/{mine['id']}").status_code == 200  # still there for its owner


def test_revoked_token_is_refused(server, api):
    created = api.post("/api/v1/tokens", json={"name": "short-lived"}).json()
    assert created["token"].startswith("td_")
    assert server.client(created["token"]).get("/api/v1/users/me").json()["username"] == "admin"
    listed = api.get("/api/v1/tokens").json()["data"]
    assert all("token" not in t for t in listed), "a listed token must never show its secret"
    assert api.delete(f"/api/v1/tokens/{created['id']}").status_code == 200
    assert server.client(created["token"]).get("/api/v1/users/me").status_code == 401


def test_cookie_session_needs_csrf_header_for_changes(server):
    from tests.conftest import _csrf_from

    with httpx.Client(base_url=server.base_url) as browser:
        csrf = _csrf_from(browser.get("/login").text)
        r = browser.post("/login", data={"username": "admin", "password": server.admin_password, "csrf_token": csrf})
        assert r.status_code == 303
        assert "httponly" in r.headers["set-cookie"].lower() and "samesite=lax" in r.headers["set-cookie"].lower()
        assert browser.get("/api/v1/users/me").status_code == 200  # reads work with the cookie
        assert browser.post("/api/v1/tokens", json={"name": "x"}).status_code == 403  # changes need the header
        csrf = _csrf_from(browser.get("/").text)
        assert browser.post("/api/v1/tokens", json={"name": "x"}, headers={"X-CSRF-Token": csrf}).status_code == 201


def test_login_form_rejects_missing_csrf_and_wrong_password(server):
    with httpx.Client(base_url=server.base_url) as browser:
        r = browser.post("/login", data={"username": "admin", "password": server.admin_password})
        assert r.status_code in (403, 422)
        from tests.conftest import _csrf_from

        csrf = _csrf_from(browser.get("/login").text)
        r = browser.post("/login", data={"username": "admin", "password": "wrong-password", "csrf_token": csrf})
        assert r.status_code == 401 and "Wrong username or password" in r.text


@pytest.mark.parametrize("path", ["/", "/datasets", "/pools", "/settings/tokens"])
def test_pages_redirect_to_login(server, path):
    r = server.anonymous().get(path)
    assert r.status_code == 303 and r.headers["location"].startswith("/login?next=")


def test_only_admins_create_users_and_pools(server):
    _, _, token = make_user(server)
    user = server.client(token)
    assert user.post("/api/v1/users", json={"username": "mallory", "password": "12345678xx"}).status_code == 403
    pool = {"name": "gpu-x", "accelerator": "gpu-h100x2", "chips": 2, "price_per_chip_hour": 3.0}
    assert user.post("/api/v1/pools", json=pool).status_code == 403
