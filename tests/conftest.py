"""Test harness: a real `tunedeck up` (uvicorn + a Celery worker) on a temporary data dir.

By default everything is embedded (SQLite, the SQLite-file broker). With
TUNEDECK_TEST_DATABASE_URL (a PostgreSQL server URL) and TUNEDECK_TEST_BROKER_URL (a Redis URL)
the same suite runs against those: a fresh database is created for the session and the Redis
database is flushed first.
"""

import asyncio
import concurrent.futures
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
# The tiny model's programs run in milliseconds on the CPU; what the suite spends on them is compiling
# them (all of them, on a machine whose JAX cache is empty). Every JAX process of the tests, the servers'
# included, compiles without LLVM's costly optimisations: about a quarter less CPU where it compiles. The
# HLO XLA optimises, and its buffer assignment (what the memory test reads), do not depend on them.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()


def run_async(coro):
    """asyncio.run(coro) in a thread of its own: Playwright's sync API keeps an event loop running in
    this thread once a browser test has run in the process, and asyncio.run refuses to nest."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fresh_postgres(url: str) -> str:
    import sqlalchemy as sa

    name = f"tunedeck_test_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return str(sa.make_url(url).set(database=name).render_as_string(hide_password=False))


def _next_redis_db() -> int:
    """15, 14, ... 4, then round again. Kept in the environment, not in this module: pytest imports
    this file twice (as `conftest` and as `tests.conftest`), and both copies must share the count."""
    db = int(os.environ.get("TUNEDECK_TEST_NEXT_REDIS_DB", "15"))
    os.environ["TUNEDECK_TEST_NEXT_REDIS_DB"] = str(db - 1 if db > 4 else 15)
    return db


def _redis_db(url: str, db: int) -> str:
    base, _, _ = url.rstrip("/").rpartition("/") if url.rstrip("/").rsplit("/", 1)[-1].isdigit() else (url, "", "")
    return f"{base.rstrip('/')}/{db}"


def _flush_redis(url: str) -> None:
    import redis

    redis.Redis.from_url(url).flushdb()


@dataclass
class Server:
    base_url: str
    data_dir: Path
    env: dict
    admin_username: str
    admin_password: str
    admin_token: str
    proc: subprocess.Popen
    log_path: Path
    _clients: list = field(default_factory=list)

    def client(self, token: str | None = None, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token or self.admin_token}"}
        c = httpx.Client(base_url=self.base_url, headers=headers, timeout=30, **kwargs)
        self._clients.append(c)
        return c

    def anonymous(self) -> httpx.Client:
        c = httpx.Client(base_url=self.base_url, timeout=30)
        self._clients.append(c)
        return c

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def sql(self, statement: str, **params) -> list:
        """Run SQL on the server's own database: how a test stages what a lost host or a lost
        message leaves behind (rows no live process would write)."""
        import sqlalchemy as sa

        url = self.env.get("TUNEDECK_DATABASE_URL") or f"sqlite:///{self.data_dir / 'tunedeck.db'}"
        engine = sa.create_engine(url)
        try:
            with engine.begin() as conn:
                result = conn.execute(sa.text(statement), params)
                return list(result) if result.returns_rows else []
        finally:
            engine.dispose()

    def wait_for(self, predicate, timeout: float = 60, interval: float = 0.2, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n--- server log ---\n{self.log()[-4000:]}")


def start_server(data_dir: Path, extra_env: dict | None = None) -> Server:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("TUNEDECK_DATABASE_URL", "TUNEDECK_BROKER_URL")}
    env.update(
        {
            "TUNEDECK_DATA_DIR": str(data_dir),
            "TUNEDECK_HOST": "127.0.0.1",
            "TUNEDECK_PORT": str(port),
            "TUNEDECK_ADMIN_PASSWORD": secrets.token_urlsafe(12),
            "TUNEDECK_ADMIN_TOKEN": "td_test_" + secrets.token_urlsafe(24),
            "TUNEDECK_WORKER_HEARTBEAT_SECONDS": "1",
            "TUNEDECK_PROBE_SECONDS": "1",
            # the gateway remembers a model's endpoint for the session: tests see it re-route when one goes
            "TUNEDECK_GATEWAY_ROUTE_SECONDS": "3600",
            # No training process waits ahead (its imports cost each server seconds of CPU, mostly for
            # tests that train nothing); the run test that kills a worker turns it on, and checks it.
            "TUNEDECK_TRAINING_STANDBY": "0",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if os.environ.get("TUNEDECK_TEST_DATABASE_URL") and not (extra_env or {}).get("TUNEDECK_DATABASE_URL"):
        env["TUNEDECK_DATABASE_URL"] = _fresh_postgres(os.environ["TUNEDECK_TEST_DATABASE_URL"])
    if os.environ.get("TUNEDECK_TEST_BROKER_URL"):
        # A Redis database of its own: servers alive at the same time must not take each other's tasks.
        url = _redis_db(os.environ["TUNEDECK_TEST_BROKER_URL"], _next_redis_db())
        _flush_redis(url)
        env["TUNEDECK_BROKER_URL"] = url
    env.update(extra_env or {})  # a restart passes its first start's database and broker here
    env = {k: v for k, v in env.items() if not (k in ("TUNEDECK_DATABASE_URL", "TUNEDECK_BROKER_URL") and not v)}
    password, token = env["TUNEDECK_ADMIN_PASSWORD"], env["TUNEDECK_ADMIN_TOKEN"]
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "up"],
        cwd=ROOT,
        env=env,
        stdout=open(log_path, "wb"),
        stderr=subprocess.STDOUT,
    )
    server = Server(f"http://127.0.0.1:{port}", data_dir, env, "admin", password, token, proc, log_path)

    def healthy():
        if proc.poll() is not None:
            raise AssertionError(f"tunedeck up exited with {proc.returncode}\n{server.log()[-4000:]}")
        try:
            return httpx.get(f"{server.base_url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        server.wait_for(healthy, timeout=90, what="/healthz")
        if not env["TUNEDECK_ADMIN_TOKEN"]:  # first start without preset secrets: they are printed once
            import re

            log = server.log()
            server.admin_password = re.search(r"with password: (\S+)", log).group(1)
            server.admin_token = token = re.search(r"\(shown once\): (td_\S+)", log).group(1)

        def worker_online():
            pools = httpx.get(
                f"{server.base_url}/api/v1/pools/cpu", headers={"Authorization": f"Bearer {token}"}, timeout=5
            )
            return pools.status_code == 200 and pools.json()["workers_online"] >= 1

        server.wait_for(worker_online, timeout=90, what="the cpu worker's heartbeat")
    except BaseException:
        stop_server(server)
        raise
    return server


def stop_server(server: Server, timeout: float = 30, keep_data: bool = False) -> int:
    """Ctrl-C on `tunedeck up`; unless its data is kept for a restart, its database dropped and the
    endpoints it started ended too (they outlive `up` by design, and a test that failed before
    stopping its own would leave them probing every second)."""
    for c in server._clients:
        c.close()
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
        try:
            server.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    if keep_data:
        return server.proc.returncode
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("TUNEDECK_DATA_DIR") == str(server.data_dir) and proc.pid != os.getpid():
                proc.kill()
    url = server.env.get("TUNEDECK_DATABASE_URL")
    if url and url.startswith("postgresql"):
        import sqlalchemy as sa

        engine = sa.create_engine(sa.make_url(url).set(database="postgres"), isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{sa.make_url(url).database}" WITH (FORCE)'))
        engine.dispose()
    return server.proc.returncode


def start_worker(
    server: Server,
    data_dir: Path,
    pool: str,
    hidden: list[Path] = (),
    args: list[str] = (),
    name: str = "host-b",
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """A worker on "another host" of ``server``'s deployment: its own data dir, the deployment's database,
    broker and secret, and none of ``hidden`` (each mounted over by an empty tmpfs in a mount namespace of
    its own, so the worker and what it starts cannot see the files there). Stop it with stop_worker."""
    import shlex

    env = {
        **server.env,
        "TUNEDECK_DATA_DIR": str(data_dir),
        "TUNEDECK_DATABASE_URL": server.env.get("TUNEDECK_DATABASE_URL")
        or f"sqlite:///{server.data_dir / 'tunedeck.db'}",
        "TUNEDECK_BROKER_URL": server.env.get("TUNEDECK_BROKER_URL")
        or f"sqla+sqlite:///{server.data_dir / 'broker.db'}",
        "TUNEDECK_WEB_URL": server.base_url,
        "TUNEDECK_SECRET_KEY": (server.data_dir / "secret_key").read_text().strip(),
        "TUNEDECK_TPU_METADATA_URL": "http://127.0.0.1:9",  # no Cloud TPU VM here: nothing listens, refused at once
        **(env or {}),
    }
    data_dir.mkdir(parents=True, exist_ok=True)
    for path in hidden:
        path.mkdir(parents=True, exist_ok=True)
    mounts = "".join(f"mount -t tmpfs none {shlex.quote(str(p))} && " for p in hidden)
    command = [sys.executable, "-m", "app.cli", "worker", "--pool", pool, "--name", f"{pool}@{name}", *args]
    worker = "exec " + " ".join(shlex.quote(c) for c in command)
    return subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", mounts + worker],
        cwd=ROOT,
        env=env,
        stdout=open(data_dir / "worker.log", "wb"),
        stderr=subprocess.STDOUT,
    )


def stop_worker(proc: subprocess.Popen, data_dir: Path) -> None:
    """Stop a worker of start_worker, and whatever it started (endpoint supervisors, model servers)."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for other in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if other.environ().get("TUNEDECK_DATA_DIR") == str(data_dir) and other.pid != os.getpid():
                other.kill()


def pytest_collection_modifyitems(config, items):
    """A test that restarts PostgreSQL runs in the PostgreSQL suite only: beside it, in CI, the SQLite
    suite runs at the same time, and must not see the server it does not use go away."""
    if os.environ.get("TUNEDECK_TEST_DATABASE_URL"):
        return
    kept = [item for item in items if item.get_closest_marker("restarts_postgres") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    srv = start_server(tmp_path_factory.mktemp("tunedeck"))
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def api(server) -> httpx.Client:
    """An API client authenticated as the admin."""
    return server.client()


def make_user(server: Server, username: str | None = None) -> tuple[str, str, str]:
    """Create a user through the API; returns (username, password, token)."""
    username = username or f"user-{uuid.uuid4().hex[:8]}"
    password = secrets.token_urlsafe(12)
    admin = server.client()
    r = admin.post("/api/v1/users", json={"username": username, "password": password})
    assert r.status_code == 201, r.text
    return username, password, _token_for(server, username, password)


def login(server: Server, username: str, password: str) -> httpx.Client:
    """A client logged in through the dashboard's form (its session cookie), as a browser is."""
    browser = httpx.Client(base_url=server.base_url, follow_redirects=False, timeout=30)
    server._clients.append(browser)
    csrf = _csrf_from(browser.get("/login").text)
    r = browser.post("/login", data={"username": username, "password": password, "csrf_token": csrf, "next": "/"})
    assert r.status_code == 303, r.text
    return browser


def _token_for(server: Server, username: str, password: str) -> str:
    """Log in through the dashboard's form and mint a token with the session cookie."""
    browser = login(server, username, password)
    csrf = _csrf_from(browser.get("/settings/tokens").text)
    r = browser.post("/api/v1/tokens", json={"name": "tests"}, headers={"X-CSRF-Token": csrf})
    assert r.status_code == 201, r.text
    browser.close()
    return r.json()["token"]


def _csrf_from(html: str) -> str:
    import re

    m = re.search(r'name="csrf-token" content="([^"]+)"', html) or re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert m, "no CSRF token on the page"
    return m.group(1)


def upload(client: httpx.Client, name: str, content: bytes, **fields) -> httpx.Response:
    return client.post("/api/v1/datasets", files={"file": (name, content)}, data=fields)


def wait_dataset(server: Server, client: httpx.Client, dataset_id: str, timeout: float = 60) -> dict:
    def done():
        d = client.get(f"/api/v1/datasets/{dataset_id}").json()
        return d if d["status"] != "validating" else None

    return server.wait_for(done, timeout=timeout, what=f"dataset {dataset_id} to finish validating")


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    """A fresh browser context, logged in as the admin."""
    context = browser.new_context(base_url=server.base_url, viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.goto("/login")
    pg.fill("input[name=username]", server.admin_username)
    pg.fill("input[name=password]", server.admin_password)
    pg.click("button[type=submit]")
    pg.wait_for_url(f"{server.base_url}/")
    yield pg
    context.close()
