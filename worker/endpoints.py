"""Serving an endpoint: a supervisor process per endpoint (`python -m worker.endpoints ENDPOINT_ID
WORKER`) that starts the model server, follows its phases to ready, beats the endpoint's heartbeat,
probes it every TUNEDECK_PROBE_SECONDS once ready (a small streamed request, then a scrape of its
/metrics: one sample), stops it when asked, and records why it died if it dies.

The Celery task only launches the supervisor, in a session of its own, and returns: an endpoint lives
for hours and must hold no worker slot (training and merges need them), nor die when the worker
process that launched it is recycled.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app.artifacts.models import Artifact
from app.core.config import get_settings
from app.core.db import session_scope
from app.endpoints import service as endpoints
from app.endpoints.models import Endpoint, EndpointStatus
from worker.probe import Scraper, probe
from worker.runs import die_with_parent

POLL_S = 0.5
STOP_GRACE_S = 20.0
PHASE_PREFIX = "tunedeck-phase: "  # what the model server prints as it goes (worker/serve/server.py)


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


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def exit_reason(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def supervise(endpoint_id: str, worker: str) -> None:
    with session_scope() as session:
        endpoint = endpoints.start(session, endpoint_id, worker, os.getpid())
        if endpoint is None:
            return
        artifact = session.get(Artifact, endpoint.artifact_id)
        host = get_settings().serve_host
        port = free_port(host)
        url = f"http://{host}:{port}"
        log = log_path(endpoint_id).with_suffix(".server.log")
        with open(log, "ab") as out:
            child = subprocess.Popen(
                [sys.executable, "-m", "worker.serve", "--model", artifact.path]
                + ["--served-model-name", endpoint.model, "--host", host, "--port", str(port)]
                + ["--max-model-len", str(endpoint.settings["max_model_len"])]
                + ["--max-num-seqs", str(endpoint.settings["max_num_seqs"])],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
        endpoints.phase(session, endpoint, "loading", url)
        try:
            _follow(session, endpoint, child, url, log)
        finally:
            _stop(child)


def _follow(session, endpoint: Endpoint, child: subprocess.Popen, url: str, log: Path) -> None:
    seen = 0
    scraper = Scraper(url)
    probed_at = 0.0
    while True:
        code = child.poll()
        if code is not None:
            endpoints.fail(session, endpoint, f"the model server {exit_reason(code)}: {_last_line(log)}")
            return
        status = endpoints.heartbeat(session, endpoint)
        if status == EndpointStatus.stopping:
            _stop(child)
            endpoints.stopped(session, endpoint)
            return
        if status not in (EndpointStatus.starting, EndpointStatus.ready):
            return  # failed or stopped from elsewhere
        if status == EndpointStatus.ready and time.monotonic() - probed_at >= get_settings().probe_seconds:
            probed_at = time.monotonic()
            _probe(session, endpoint, url, scraper)
        if status == EndpointStatus.starting:
            text = log.read_text(errors="replace") if log.exists() else ""
            lines = text[seen:].splitlines()
            phases = [line.removeprefix(PHASE_PREFIX).strip() for line in lines if line.startswith(PHASE_PREFIX)]
            seen = len(text)
            if phases:
                endpoints.phase(session, endpoint, phases[-1])
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    endpoints.ready(session, endpoint, url)
            except httpx.HTTPError:
                pass
        time.sleep(POLL_S)


def _probe(session, endpoint: Endpoint, url: str, scraper: Scraper) -> None:
    """A probe request, then a scrape of /metrics (which so counts the probe too), as one sample."""
    sample = probe(url, endpoint.model)
    try:
        sample |= scraper()
    except httpx.HTTPError as exc:
        sample["error"] = sample["error"] or f"scraping /metrics failed: {exc}"
    endpoints.record_sample(session, endpoint.id, "probe", **sample)


def _last_line(log: Path) -> str:
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    lines = [line for line in tail.splitlines() if line.strip() and not line.startswith(PHASE_PREFIX)]
    return lines[-1][:500] if lines else "(no output)"


def _stop(child: subprocess.Popen) -> None:
    if child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


if __name__ == "__main__":
    supervise(sys.argv[1], sys.argv[2])
