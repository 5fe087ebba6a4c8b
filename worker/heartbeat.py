"""A worker's heartbeat: `last_seen` written every few seconds, so the dashboard knows who is online;
and on each beat, runs and artifact builds of this pool whose own heartbeat went silent are re-queued,
its silent endpoints marked failed (their model server went with their host), its silent
benchmarks failed (the worker sending their load was lost), and the tasks of rows of any pool
that wait for a task their queue lost are sent again (`queue.resend_lost`)."""

import logging
import threading

from app.artifacts import service as artifacts
from app.benchmarks import service as benchmarks
from app.core import queue
from app.core.config import get_settings
from app.core.db import session_scope, utcnow
from app.datasets import service as datasets
from app.endpoints import service as endpoints
from app.pools import service as pools
from app.runs import service as runs

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, hostname: str, pool: str, pid: int) -> None:
        self.hostname, self.pool, self.pid = hostname, pool, pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tunedeck-heartbeat", daemon=True)

    def start(self) -> None:
        self._guarded_beat()  # a first beat that fails (database not up yet, say) must not stop the rest
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with session_scope() as session:
            pools.worker_stopped(session, self.hostname)

    def _beat(self) -> None:
        with session_scope() as session:
            pools.heartbeat(session, self.hostname, self.pool, self.pid)
            for run_id in runs.requeue_stale(session, self.pool):
                log.warning("run %s lost its worker: re-queued", run_id)
            for artifact_id in artifacts.requeue_stale(session, self.pool):
                log.warning("artifact %s lost its worker: re-queued", artifact_id)
            for benchmark_id in benchmarks.fail_stale(session, self.pool):
                log.warning("benchmark %s lost its worker: failed", benchmark_id)
            for endpoint_id in endpoints.fail_stale(session, self.pool):
                log.warning("endpoint %s lost its worker", endpoint_id)
            waiting = [
                *datasets.waiting_tasks(session),
                *runs.waiting_tasks(session),
                *artifacts.waiting_tasks(session),
                *endpoints.waiting_tasks(session),
                *benchmarks.waiting_tasks(session),
            ]
            for row_id in queue.resend_lost(waiting, utcnow()):
                log.warning("%s waited for a task its queue did not hold: sent again", row_id)

    def _run(self) -> None:
        interval = get_settings().worker_heartbeat_seconds
        while not self._stop.wait(interval):
            self._guarded_beat()

    def _guarded_beat(self) -> None:
        try:
            self._beat()
        except Exception:  # noqa: BLE001 - a missed beat must not kill the worker or its heartbeat
            log.exception("heartbeat failed")
