"""Accounts: failed logins are limited per account and per address, a password check costs the same
whether the user exists or not and runs a few at a time, passwords can be changed, admins can
disable users (their tokens, sessions and live streams end at once), and tokens can expire."""

import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import httpx

from tests.api.test_limits import web_process
from tests.conftest import _csrf_from, login, make_user

MB = 1024**2


def new_user(api: httpx.Client) -> tuple[int, str, str]:
    """(id, username, password) of a user made through the API."""
    name, password = f"acct-{uuid.uuid4().hex[:8]}", f"pw-{uuid.uuid4().hex}"
    r = api.post("/api/v1/users", json={"username": name, "password": password})
    assert r.status_code == 201, r.text
    return r.json()["id"], name, password


def login_form(server, address: str) -> tuple[httpx.Client, str]:
    """A browser-like client seen as coming from `address` (the server trusts X-Forwarded-For from
    its local proxy, as behind nginx), and the login form's CSRF token."""
    client = httpx.Client(base_url=server.base_url, headers={"X-Forwarded-For": address}, timeout=60)
    server._clients.append(client)
    return client, _csrf_from(client.get("/login").text)


def try_login(client: httpx.Client, csrf: str, username: str, password: str) -> httpx.Response:
    return client.post("/login", data={"username": username, "password": password, "csrf_token": csrf, "next": "/"})


# ---------- login ----------


def test_failed_logins_are_limited_per_account_and_per_address(server, api):
    _, name, password = new_user(api)
    client, csrf = login_form(server, "198.51.100.1")
    for i in range(5):
        assert try_login(client, csrf, name, f"guess-{i}").status_code == 401
    r = try_login(client, csrf, name, password)  # the right password waits too now
    assert r.status_code == 429, r.text
    assert 0 < int(r.headers["retry-after"]) <= 60
    assert "Too many failed logins for this account" in r.text
    assert f"try again in {r.headers['retry-after']} seconds" in r.text
    elsewhere, csrf2 = login_form(server, "198.51.100.2")
    assert try_login(elsewhere, csrf2, name, password).status_code == 429, "the account's limit holds from anywhere"

    # The same address trying other names: 20 failures in all, then it waits, whoever it tries.
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda i: try_login(client, csrf, f"nobody-{i}", "password1").status_code, range(15)))
    assert codes == [401] * 15
    r = try_login(client, csrf, "admin", server.admin_password)
    assert r.status_code == 429 and "from your address" in r.text, r.text
    assert 0 < int(r.headers["retry-after"]) <= 60
    assert try_login(elsewhere, csrf2, "admin", server.admin_password).status_code == 303, "others are not held up"


def test_an_unknown_username_takes_as_long_as_a_wrong_password(server, api):
    """Timing must not tell which usernames exist: an unknown one is checked against a dummy hash."""
    _, name, _ = new_user(api)
    client, csrf = login_form(server, "198.51.100.4")

    def timed(username: str) -> float:
        start = time.perf_counter()
        assert try_login(client, csrf, username, "not-the-password").status_code == 401
        return time.perf_counter() - start

    wrong, unknown = [], []
    for _ in range(2):
        wrong.append(timed(name))
        unknown.append(timed(f"nobody-{uuid.uuid4().hex[:8]}"))
    assert min(unknown) > 0.4 * min(wrong), (unknown, wrong)


def test_password_checks_run_a_few_at_a_time(server, api):
    """A burst of logins does not take every request thread nor 64 MiB each (argon2's memory) at
    once: the web process grows by a couple of checks' worth, not by one per request."""
    users = [new_user(api) for _ in range(2)]
    attempts = [(login_form(server, "198.51.100.5"), name) for _, name, _ in users for _ in range(3)]
    web = web_process(server)
    base = peak = web.memory_info().rss
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, web.memory_info().rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(len(attempts)) as pool:
            codes = list(pool.map(lambda a: try_login(*a[0], a[1], "wrong-password").status_code, attempts))
    finally:
        done.set()
        sampler.join()
    assert codes == [401] * len(attempts)
    assert peak - base < 200 * MB, f"the web process grew by {(peak - base) / MB:.0f} MiB"


# ---------- password change ----------


def test_changing_the_password_ends_the_other_sessions(server, api):
    _, name, password = new_user(api)
    here, there = login(server, name, password), login(server, name, password)
    page = here.get("/settings/password")
    assert page.status_code == 200 and 'name="current_password"' in page.text
    csrf = _csrf_from(page.text)
    new = f"new-{uuid.uuid4().hex}"

    def change(current, first, second, token=csrf):
        form = {"current_password": current, "new_password": first, "new_password_again": second}
        return here.post("/settings/password", data={**form, "csrf_token": token})

    assert change(password, new, new, token="forged").status_code == 403
    r = change("not-my-password", new, new)
    assert r.status_code == 400 and "The current password is wrong" in r.text
    r = change(password, new, new + "x")
    assert r.status_code == 400 and "The new passwords do not match" in r.text
    r = change(password, "short", "short")
    assert r.status_code == 400 and "at least 8 characters" in r.text
    assert there.get("/").status_code == 200, "nothing changed yet"

    r = change(password, new, new)
    assert r.status_code == 200 and "Your password was changed" in r.text
    assert here.get("/").status_code == 200, "this session goes on"
    assert there.get("/").status_code == 303, "the other session is logged out"
    assert there.get("/api/v1/users/me").status_code == 401
    client, form_csrf = login_form(server, "198.51.100.6")
    assert try_login(client, form_csrf, name, password).status_code == 401
    assert try_login(client, form_csrf, name, new).status_code == 303


# ---------- disabling users ----------


def test_an_admin_disables_a_user_and_their_tokens_and_sessions_stop_at_once(server, api):
    name, password, token = make_user(server)
    user = server.client(token)
    me = user.get("/api/v1/users/me").json()  # the token is now remembered for a few seconds
    assert me["disabled"] is False
    browser = login(server, name, password)
    assert browser.get("/").status_code == 200

    assert user.patch(f"/api/v1/users/{me['id']}", json={"disabled": True}).status_code == 403, "admins only"
    admin_id = api.get("/api/v1/users/me").json()["id"]
    r = api.patch(f"/api/v1/users/{admin_id}", json={"disabled": True})
    assert r.status_code == 409 and "your own account" in r.json()["detail"]
    assert api.patch("/api/v1/users/999999", json={"disabled": True}).status_code == 404
    r = api.patch(f"/api/v1/users/{me['id']}", json={"disabled": "maybe"})
    assert r.status_code == 422 and "disabled" in r.text

    r = api.patch(f"/api/v1/users/{me['id']}", json={"disabled": True})
    assert r.status_code == 200 and r.json()["disabled"] is True
    r = user.get("/api/v1/users/me")
    assert r.status_code == 401 and "disabled" in r.json()["detail"]
    assert user.get("/v1/models").status_code == 401
    assert browser.get("/").status_code == 303
    assert browser.get("/api/v1/users/me").status_code == 401
    client, csrf = login_form(server, "198.51.100.7")
    r = try_login(client, csrf, name, password)
    assert r.status_code == 403 and "disabled" in r.text
    listed = {u["username"]: u for u in api.get("/api/v1/users").json()["data"]}
    assert listed[name]["disabled"] is True

    # Enabled again: the tokens work again; the old sessions stay ended.
    assert api.patch(f"/api/v1/users/{me['id']}", json={"disabled": False}).json()["disabled"] is False
    assert user.get("/api/v1/users/me").status_code == 200
    assert browser.get("/").status_code == 303
    assert try_login(client, csrf, name, password).status_code == 303


def test_the_users_page_disables_and_enables(server, api):
    uid, name, password = new_user(api)
    admin = login(server, "admin", server.admin_password)
    page = admin.get("/settings/users")
    assert page.status_code == 200 and name in page.text
    csrf = _csrf_from(page.text)
    assert admin.post(f"/settings/users/{uid}", data={"disabled": "true"}).status_code == 403, "CSRF"
    r = admin.post(f"/settings/users/{uid}", data={"disabled": "true", "csrf_token": csrf})
    assert r.status_code == 303 and r.headers["location"] == "/settings/users"
    row = re.search(rf'<tr data-user="{uid}".*?</tr>', admin.get("/settings/users").text, re.S).group(0)
    assert "disabled" in row and "Enable" in row

    def disabled() -> bool:
        return next(u for u in api.get("/api/v1/users").json()["data"] if u["id"] == uid)["disabled"]

    assert disabled()
    r = admin.post(f"/settings/users/{uid}", data={"disabled": "false", "csrf_token": csrf})
    assert r.status_code == 303 and not disabled()

    member = login(server, name, password)
    assert member.get("/settings/users").status_code == 403
    r = member.post(f"/settings/users/{uid}", data={"disabled": "true", "csrf_token": _csrf_from(member.get("/").text)})
    assert r.status_code == 403


# ---------- live streams ----------


def follow(client: httpx.Client, url: str) -> dict:
    """Read a server-sent event stream in a thread: its event names, and when it ended."""
    seen: dict = {"events": [], "ended": None}

    def read():
        try:
            with client.stream("GET", url, timeout=httpx.Timeout(60)) as r:
                seen["status"] = r.status_code
                for line in r.iter_lines():
                    if seen.get("stop"):
                        return
                    if line.startswith("event:"):
                        seen["events"].append(line.partition(":")[2].strip())
                    if line.startswith("data:") and seen["events"][-1:] == ["unauthorized"]:
                        seen["reason"] = line.partition(":")[2].strip()
            seen["ended"] = time.monotonic()
        except httpx.HTTPError:  # closed by the test
            pass

    seen["thread"] = threading.Thread(target=read, daemon=True)
    seen["thread"].start()
    deadline = time.monotonic() + 20
    while "update" not in seen["events"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "update" in seen["events"], seen
    return seen


def test_watches_end_when_the_token_is_revoked_or_the_user_disabled(server, api):
    revoked = api.post("/api/v1/tokens", json={"name": "watch"}).json()
    name, password, token = make_user(server)
    user_id = server.client(token).get("/api/v1/users/me").json()["id"]
    streams = {
        "revoked token": follow(server.client(revoked["token"]), "/api/v1/pools?watch=true"),
        "disabled user's token": follow(server.client(token), "/api/v1/datasets?watch=true"),
        "disabled user's cookie": follow(login(server, name, password), "/api/v1/pools?watch=true"),
        "another user": follow(server.client(), "/api/v1/pools?watch=true"),  # the admin's
    }
    acted = time.monotonic()
    assert api.delete(f"/api/v1/tokens/{revoked['id']}").status_code == 200
    assert api.patch(f"/api/v1/users/{user_id}", json={"disabled": True}).status_code == 200
    for what in ("revoked token", "disabled user's token", "disabled user's cookie"):
        seen = streams[what]
        seen["thread"].join(timeout=max(0.1, 15 - (time.monotonic() - acted)))
        assert seen["ended"] is not None, f"the {what}'s stream goes on"
        assert seen["ended"] - acted < 10, what
        assert seen["events"][-1] == "unauthorized" and seen["reason"], (what, seen)
    assert "revoked" in streams["revoked token"]["reason"]
    assert "disabled" in streams["disabled user's token"]["reason"]
    assert "session has ended" in streams["disabled user's cookie"]["reason"]
    assert streams["another user"]["ended"] is None, "other watches go on"
    streams["another user"]["stop"] = True  # its thread leaves at the stream's next line (a ping, at most 15 s)


# ---------- token expiry ----------


def test_tokens_can_expire(server, api):
    for bad in (0, -1, 366, 1.5, "soon"):
        r = api.post("/api/v1/tokens", json={"name": "x", "expires_in_days": bad})
        assert r.status_code == 422 and "expires_in_days" in r.text, (bad, r.text)
    tag = uuid.uuid4().hex[:6]
    forever = api.post("/api/v1/tokens", json={"name": f"forever-{tag}"}).json()
    assert forever["expires_at"] is None
    month = api.post("/api/v1/tokens", json={"name": f"month-{tag}", "expires_in_days": 30}).json()
    expires = datetime.fromisoformat(month["expires_at"]).replace(tzinfo=UTC)
    assert abs(expires - (datetime.now(UTC) + timedelta(days=30))) < timedelta(minutes=5)
    assert server.client(month["token"]).get("/api/v1/users/me").status_code == 200

    lapsed = api.post("/api/v1/tokens", json={"name": f"lapsed-{tag}", "expires_in_days": 1}).json()
    server.sql("UPDATE api_tokens SET expires_at = :at WHERE id = :id", at="2000-01-02 03:04:05", id=lapsed["id"])
    r = server.client(lapsed["token"]).get("/api/v1/users/me")
    assert r.status_code == 401 and "expired" in r.json()["detail"] and "2000-01-02" in r.json()["detail"]
    r = server.client(lapsed["token"]).get("/v1/models")
    assert r.status_code == 401 and "expired" in r.json()["error"]["message"]
    listed = {t["name"]: t for t in api.get("/api/v1/tokens").json()["data"]}
    assert listed[f"lapsed-{tag}"]["expires_at"].startswith("2000-01-02")

    page = login(server, "admin", server.admin_password).get("/settings/tokens").text

    def row(name: str) -> str:
        return re.search(rf"<tr[^>]*>\s*<td><strong>{name}</strong>.*?</tr>", page, re.S).group(0)

    assert "expired" in row(f"lapsed-{tag}") and "2000-01-02" in row(f"lapsed-{tag}")
    assert expires.strftime("%Y-%m-%d") in row(f"month-{tag}") and "active" in row(f"month-{tag}")
    assert "never" in row(f"forever-{tag}")
