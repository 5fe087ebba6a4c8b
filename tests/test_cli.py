"""`tunedeck up` as a newcomer runs it, and the rest of the CLI."""

import subprocess
import sys

import httpx

from tests.conftest import ROOT, start_server, stop_server


def test_first_start_prints_login_and_token_then_stops_cleanly_on_ctrl_c(tmp_path):
    srv = start_server(
        tmp_path / "first",
        {"TUNEDECK_ADMIN_PASSWORD": "", "TUNEDECK_ADMIN_TOKEN": "", "TUNEDECK_MAX_UPLOAD_BYTES": "1000"},
    )
    try:
        log = srv.log()
        assert f"Tunedeck: {srv.base_url}" in log
        me = httpx.get(f"{srv.base_url}/api/v1/users/me", headers={"Authorization": f"Bearer {srv.admin_token}"})
        assert me.json()["username"] == "admin" and me.json()["is_admin"]
        with httpx.Client(base_url=srv.base_url) as browser:
            import re

            csrf = re.search(r'name="csrf_token" value="([^"]+)"', browser.get("/login").text).group(1)
            r = browser.post("/login", data={"username": "admin", "password": srv.admin_password, "csrf_token": csrf})
            assert r.status_code == 303

        # The size limit is answered with 413, whether declared up front or found while streaming.
        api = srv.client()
        r = api.post("/api/v1/datasets", files={"file": ("big.jsonl", b"x" * 5000)})
        assert r.status_code == 413 and "1000 bytes" in r.json()["detail"]

        def chunked():
            yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
            for _ in range(10):
                yield b"y" * 500
            yield b"\r\n--b--\r\n"

        r = api.post("/api/v1/datasets", content=chunked(), headers={"Content-Type": "multipart/form-data; boundary=b"})
        assert r.status_code == 413
        assert api.get("/api/v1/datasets").json()["count"] == 0
        assert not list((srv.data_dir / "storage" / "datasets").rglob("*.part"))
    finally:
        code = stop_server(srv, drop_database=False)
    assert code == 0, srv.log()[-3000:]
    assert "tunedeck: stopped" in srv.log()

    # A second start keeps the data and prints no new secrets.
    again = start_server(
        srv.data_dir,
        {
            "TUNEDECK_ADMIN_PASSWORD": "unused-now",
            "TUNEDECK_ADMIN_TOKEN": srv.admin_token,
            "TUNEDECK_DATABASE_URL": srv.env.get("TUNEDECK_DATABASE_URL", ""),
        },
    )
    try:
        assert "First start" not in again.log()
    finally:
        assert stop_server(again) == 0


def _cli(*args, env=None, input=None):
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=ROOT,
        env=env,
        input=input,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_token_create_prints_a_working_token(server):
    r = _cli("token", "create", "--name", "ci", env=server.env)
    assert r.returncode == 0, r.stderr
    token = r.stdout.strip().splitlines()[-1]
    assert token.startswith("td_")
    me = httpx.get(f"{server.base_url}/api/v1/users/me", headers={"Authorization": f"Bearer {token}"})
    assert me.status_code == 200
    names = [t["name"] for t in server.client(token).get("/api/v1/tokens").json()["data"]]
    assert "ci" in names


def test_token_create_for_unknown_user_fails(server):
    r = _cli("token", "create", "--name", "x", "--user", "nobody", env=server.env)
    assert r.returncode == 2 and "no user named 'nobody'" in r.stderr


def test_db_upgrade_is_idempotent(server):
    r = _cli("db", "upgrade", env=server.env)
    assert r.returncode == 0 and "up to date" in r.stdout


def test_user_create(server):
    r = _cli("user", "create", "--username", "carol", "--password", "carol-password", env=server.env)
    assert r.returncode == 0, r.stderr
    r = _cli("user", "create", "--username", "carol", "--password", "carol-password", env=server.env)
    assert r.returncode == 2 and "taken" in r.stderr
    r = _cli("user", "create", "--username", "dan", "--password", "short", env=server.env)
    assert r.returncode == 2 and "password" in r.stderr
