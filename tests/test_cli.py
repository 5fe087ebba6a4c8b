"""`tunedeck up` as a newcomer runs it, and the rest of the CLI."""

import os
import signal
import subprocess
import sys

import httpx

from tests.api.test_runs_lifecycle import SMALL, demo_dataset, steps_of
from tests.conftest import ROOT, start_server, stop_server


def test_first_start_prints_login_and_token_and_ctrl_c_hands_the_training_back(tmp_path):
    """A first start, then Ctrl-C while a run trains: the worker has it checkpoint where it is and stop,
    so `tunedeck up` stops within seconds and cleanly; the next start resumes the run from that step."""
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

        config = {**SMALL, "max_steps": 1000, "checkpoint_every_steps": 1000}  # no checkpoint of its own
        run_id = api.post("/api/v1/runs", json={"dataset_id": demo_dataset(srv, api), "config": config}).json()["id"]
        srv.wait_for(lambda: api.get(f"/api/v1/runs/{run_id}").json()["step"] >= 3, timeout=120, what="training")
    finally:
        code = stop_server(srv, keep_data=True)
    # 0: every process stopped by itself, within the 20 s `up` gives them (it kills the rest, and exits 1).
    # That the training saved a checkpoint where it was, rather than being killed by its supervisor once
    # its own grace period ran out, shows in the resume below: from the step it was handed back at.
    assert code == 0, srv.log()[-3000:]
    assert "tunedeck: stopped" in srv.log()

    # A second start keeps the data and prints no new secrets.
    again = start_server(
        srv.data_dir,
        {
            "TUNEDECK_ADMIN_PASSWORD": "unused-now",
            "TUNEDECK_ADMIN_TOKEN": srv.admin_token,
            "TUNEDECK_DATABASE_URL": srv.env.get("TUNEDECK_DATABASE_URL", ""),
            "TUNEDECK_BROKER_URL": srv.env.get("TUNEDECK_BROKER_URL", ""),  # where the run was queued again
        },
    )
    try:
        assert "First start" not in again.log()
        api = again.client()

        def messages():
            return [e["message"] for e in api.get(f"/api/v1/runs/{run_id}/events").json()["data"]]

        handed = next(m for m in messages() if m.startswith("handed back at step "))
        step = int(handed.split()[4].rstrip(","))
        again.wait_for(
            lambda: api.get(f"/api/v1/runs/{run_id}").json()["step"] > step + 2, timeout=120, what="the resumed run"
        )
        run = api.get(f"/api/v1/runs/{run_id}").json()
        assert run["status"] == "running" and run["attempts"] == 2, run
        assert f"resumed from step {step}" in messages()
        steps = steps_of(api, run_id)
        assert steps == list(range(1, len(steps) + 1)), "each step once: none twice, none skipped"
        assert api.post(f"/api/v1/runs/{run_id}/cancel").status_code == 200
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


def test_a_short_admin_token_is_refused_at_start(tmp_path):
    """TUNEDECK_ADMIN_TOKEN is an admin's key to everything: one shorter than 32 characters stops the
    start with a message saying so, before anything listens or is written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEDECK_")}
    env.update({"TUNEDECK_DATA_DIR": str(tmp_path), "TUNEDECK_ADMIN_TOKEN": "td_" + "x" * 28})  # 31
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "up", "--port", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError("tunedeck up started with a 31-character admin token") from None
    assert proc.returncode == 2, (out, err)
    assert "TUNEDECK_ADMIN_TOKEN must be at least 32 characters (it has 31)" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "tunedeck.db").exists()
