"""Serving an endpoint: a supervisor process per endpoint (`python -m worker.endpoints ENDPOINT_ID
WORKER`) that starts its model server through the endpoint's runtime (worker/runtimes.py: the built-in
server, or vLLM's container), follows its phases to ready, beats the endpoint's heartbeat with the tail
of the server's output, probes it every TUNEDECK_PROBE_SECONDS once ready (a small streamed request,
then a scrape of its /metrics: one sample), stops it when asked, and records why it died if it dies.

The Celery task only launches the supervisor, in a session of its own, and returns: an endpoint lives
for hours and must hold no worker slot (training and merges need them), nor die when the worker
process that launched it is recycled.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from sqlalchemy.exc import DBAPIError

from app.artifacts import service as artifacts
from app.artifacts.models import Artifact, ArtifactKind
from app.core.config import get_settings
from app.core.db import session_scope
from app.endpoints import service as endpoints
from app.endpoints.models import Endpoint, EndpointStatus
from app.pools.models import Pool
from app.runs.models import Run
from worker import leases, runtimes
from worker.model_cache import local_artifact
from worker.probe import Scraper, auth, probe
from worker.processes import free_port
from worker.runs import base_model_dir

POLL_S = 0.5
LOG_EVERY_S = 2.0  # how often the server's latest output is copied to the endpoint


def log_path(endpoint_id: str) -> Path:
    return get_settings().data_dir / "endpoints" / f"{endpoint_id}.log"


def launch(endpoint_id: str, worker: str) -> None:
    """The Celery task's body: start the endpoint's supervisor and return."""
    path = log_path(endpoint_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as out:
        subprocess.Popen(
            [sys.executable, "-m", "worker.endpoints", endpoint_id, worker],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def supervise(endpoint_id: str, worker: str) -> None:
    lease = leases.take_or_wait(  # held for as long as this supervisor lives: its model server's chips
        f"endpoint {endpoint_id}",
        lambda session, why, retry_s: endpoints.wait_for_chips(session, endpoint_id, why, retry_s),
    )
    if lease is None:
        return
    with session_scope() as session:
        endpoint = endpoints.start(session, endpoint_id, worker, os.getpid())
        if endpoint is None:
            return
        artifact = session.get_one(Artifact, endpoint.artifact_id)  # deleting it deletes its endpoints
        base_dir = None
        if artifact.kind == ArtifactKind.adapter:
            base_dir = str(base_model_dir(session, session.get_one(Run, artifact.run_id))[0])
        host = get_settings().serve_host
        port = free_port(host)
        url = f"http://{host}:{port}"
        try:
            endpoints.phase(session, endpoint, "copying", url)
            model_dir = local_artifact(
                artifact, lambda: artifacts.served(session), log=lambda line: print(line, flush=True)
            )
            server = runtimes.model_server(
                endpoint,
                artifact,
                session.get(Pool, endpoint.pool),
                model_dir=str(model_dir),
                host=host,
                port=port,
                log=log_path(endpoint_id).with_suffix(".server.log"),
                base_dir=base_dir,
            )
        except Exception as exc:  # nothing started: the endpoint fails with the reason
            endpoints.fail(session, endpoint, f"{type(exc).__name__}: {exc}")
            raise
        try:
            server.start(lambda name: endpoints.phase(session, endpoint, name, url))
            _follow(session, endpoint, server, url)
        except Exception as exc:
            endpoints.fail(session, endpoint, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            server.stop()
            endpoints.heartbeat(session, endpoint, _tail(server.log()))


class _Follower:
    """One pass of the supervisor's loop at a time (`step`): beat, notice a stop or a death, probe."""

    def __init__(self, session, endpoint: Endpoint, server: runtimes.ModelServer, url: str) -> None:
        self.session, self.endpoint, self.server, self.url = session, endpoint, server, url
        self.scraper = Scraper(url, endpoint.api_key)
        self.probed_at = self.logged_at = 0.0

    def step(self) -> bool:
        """False once the endpoint is over (its server died, or it was stopped)."""
        session, endpoint, server = self.session, self.endpoint, self.server
        reason = server.exit_reason()
        if reason is not None:
            endpoints.fail(session, endpoint, reason, _tail(server.log()))
            return False
        log = None
        if endpoint.status == EndpointStatus.starting or time.monotonic() - self.logged_at >= LOG_EVERY_S:
            log, self.logged_at = server.log(), time.monotonic()
        status = endpoints.heartbeat(session, endpoint, None if log is None else _tail(log))
        if status == EndpointStatus.stopping:
            server.stop()
            endpoints.stopped(session, endpoint, _tail(server.log()))
            return False
        if status not in (EndpointStatus.starting, EndpointStatus.ready):
            return False  # failed or stopped from elsewhere
        if status == EndpointStatus.ready and time.monotonic() - self.probed_at >= get_settings().probe_seconds:
            self.probed_at = time.monotonic()
            _probe(session, endpoint, self.url, self.scraper)
        if status == EndpointStatus.starting:
            phases = [p for p in map(server.phase_of, (log or "").splitlines()) if p]
            if phases and phases[-1] != endpoint.phase:
                endpoints.phase(session, endpoint, phases[-1])
            try:
                if httpx.get(f"{self.url}/health", headers=auth(endpoint.api_key), timeout=1).status_code == 200:
                    endpoints.ready(session, endpoint, self.url)
            except httpx.HTTPError:
                pass
        return True


def _follow(session, endpoint: Endpoint, server: runtimes.ModelServer, url: str) -> None:
    """Follow the endpoint until it is over. The database going away for a while (a restart, a
    failover) does not end it: the model server keeps serving while the supervisor retries with
    backoff, up to the stale bound (past it, the pool's workers count this host as lost anyway)."""
    follower = _Follower(session, endpoint, server, url)
    outage_since: float | None = None
    backoff = POLL_S
    while True:
        try:
            if not follower.step():
                return
            outage_since, backoff = None, POLL_S
        except DBAPIError as exc:
            _rollback(session)
            outage_since = outage_since or time.monotonic()
            if time.monotonic() - outage_since > get_settings().stale_seconds:
                raise
            print(f"database unreachable, retrying in {backoff:.1f}s: {exc.orig!r}", file=sys.stderr, flush=True)
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
            continue
        time.sleep(POLL_S)


def _rollback(session) -> None:
    try:
        session.rollback()
    except DBAPIError:
        pass  # the connection is gone: the next use takes a fresh one


def _tail(text: str) -> str:
    return "\n".join(text.splitlines()[-runtimes.LOG_LINES :])


def _probe(session, endpoint: Endpoint, url: str, scraper: Scraper) -> None:
    """A probe request, then a scrape of /metrics (which so counts the probe too), as one sample."""
    sample = probe(url, endpoint.model, endpoint.api_key)
    try:
        sample |= scraper()
    except httpx.HTTPError as exc:
        sample["error"] = sample["error"] or f"scraping /metrics failed: {exc}"
    endpoints.record_sample(session, endpoint.id, "probe", **sample)


if __name__ == "__main__":
    supervise(sys.argv[1], sys.argv[2])
