"""A worker's heartbeat: `last_seen` written every few seconds, so the dashboard knows who is online;
and on each beat, runs and artifact builds of this pool whose own heartbeat went silent are re-queued,
its silent endpoints marked failed (their model server went with their host), its silent
benchmarks and evaluations failed (the worker sending their load was lost), and the tasks of rows of any pool
that wait for a task their queue lost are sent again (`queue.resend_lost`). A worker of a TPU or GPU
pool also removes the vLLM containers of its host that no endpoint runs any more
(`runtimes.remove_orphans`)."""

import logging
import threading

from app.artifacts import service as artifacts
from app.benchmarks import service as benchmarks
from app.core import queue
from app.core.config import get_settings
from app.core.db import session_scope, utcnow
from app.datasets import service as datasets
from app.endpoints import service as endpoints
from app.endpoints.models import Runtime
from app.evaluations import service as evaluations
from app.pools import service as pools
from app.pools.models import Pool
from app.runs import service as runs
from worker import runtimes

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, hostname: str, pool: str, pid: int, slice_: tuple[str, int] | None = None) -> None:
        self.hostname, self.pool, self.pid, self.slice = hostname, pool, pid, slice_
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tunedeck-heartbeat", daemon=True)
        self._docker = None  # the Docker Engine client of a TPU or GPU pool's worker, once made

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
            pools.heartbeat(session, self.hostname, self.pool, self.pid, self.slice)
            for run_id in runs.requeue_stale(session, self.pool):
                log.warning("run %s lost its worker: re-queued", run_id)
            for artifact_id in artifacts.requeue_stale(session, self.pool):
                log.warning("artifact %s lost its worker: re-queued", artifact_id)
            for benchmark_id in benchmarks.fail_stale(session, self.pool):
                log.warning("benchmark %s lost its worker: failed", benchmark_id)
            for evaluation_id in evaluations.fail_stale(session, self.pool):
                log.warning("evaluation %s lost its worker: failed", evaluation_id)
            for endpoint_id in endpoints.fail_stale(session, self.pool):
                log.warning("endpoint %s lost its worker", endpoint_id)
            waiting = [
                *datasets.waiting_tasks(session),
                *runs.waiting_tasks(session),
                *artifacts.waiting_tasks(session),
                *endpoints.waiting_tasks(session),
                *benchmarks.waiting_tasks(session),
                *evaluations.waiting_tasks(session),
            ]
            for row_id in queue.resend_lost(waiting, utcnow()):
                log.warning("%s waited for a task its queue did not hold: sent again", row_id)

    def _remove_orphan_containers(self) -> None:
        with session_scope() as session:
            pool = session.get(Pool, self.pool)
            if pool is None or endpoints.runtime_for(pool) == Runtime.local:
                return
            try:
                self._docker = self._docker or runtimes.docker_client()
                for name in runtimes.remove_orphans(session, self._docker):
                    log.warning("removed container %s: no endpoint runs it any more", name)
            except Exception as exc:  # noqa: BLE001 - the engine is down: the next beat tries again
                self._docker = None
                log.warning("could not look for orphaned containers: %s", exc)

    def _run(self) -> None:
        interval = get_settings().worker_heartbeat_seconds
        while not self._stop.wait(interval):
            self._guarded_beat()

    def _guarded_beat(self) -> None:
        for step in (self._beat, self._remove_orphan_containers):
            try:
                step()
            except Exception:  # noqa: BLE001 - a missed beat must not kill the worker or its heartbeat
                log.exception("heartbeat failed")
