"""The Celery application as both sides see it.

The web process only *sends* tasks, by name (it never imports worker code); `worker/` registers
the tasks under the same names. Every worker consumes its pool's queue and the shared `general`
queue.

A row is committed before its task is sent (the worker must find it). So that no row waits forever
for a task that never arrived (the broker was down, or lost the message): a request that would queue
work first checks that the broker answers (`check_broker`, else 503 and nothing is written); a send
that fails after the commit is only logged; and each worker beat re-sends the tasks of rows that have
waited longer than `lost_task_seconds` while their queue holds fewer messages than it has waiting
rows (`resend_lost`). A task delivered twice is harmless: each task takes its row with a
compare-and-set and lets go of one that is no longer waiting.
"""

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

from celery import Celery

from app.core import sql_broker
from app.core.config import get_settings

log = logging.getLogger(__name__)

GENERAL_QUEUE = "general"

# Task names: the contract between app/ (sender) and worker/ (implementer).
VALIDATE_DATASET = "tunedeck.datasets.validate"
TRAIN_RUN = "tunedeck.runs.train"
BUILD_ARTIFACT = "tunedeck.artifacts.build"
START_ENDPOINT = "tunedeck.endpoints.start"
RUN_BENCHMARK = "tunedeck.benchmarks.run"
RUN_EVALUATION = "tunedeck.evaluations.run"
TRAIN_ON_HOST = "tunedeck.runs.train_on_host"  # one host's part of a run on a multi-host slice


def host_queue(pool: str, slice_: str, host_index: int) -> str:
    """The queue of one host of a slice: the part of a slice's job that runs there is sent to it."""
    return f"{pool}.{slice_}.{host_index}"


def make_celery() -> Celery:
    settings = get_settings()
    sql_broker.register()
    if settings.broker_url is None:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    celery = Celery("tunedeck", broker=settings.celery_broker_url)
    celery.conf.update(
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=GENERAL_QUEUE,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        # No results are kept, so there is none to wait for once a pool process has died (killed, out
        # of memory): its task goes back on the queue after a second instead of ten.
        worker_lost_wait=1.0,
        enable_utc=True,
    )
    if celery.conf.broker_url.startswith(("redis://", "rediss://")):
        # Tasks are acknowledged late, and a training holds its message for as long as it runs: Redis
        # would hand it to another worker after this long (where the compare-and-set turns it away).
        # Redelivery is not what recovers lost work: a lost worker's running rows are re-queued by the
        # stale sweeps, and messages lost before a worker took their row are re-sent by `resend_lost`.
        celery.conf.broker_transport_options = {"visibility_timeout": 7 * 24 * 3600}
    return celery


@lru_cache
def get_celery() -> Celery:
    return make_celery()


class BrokerUnavailable(RuntimeError):
    """The broker does not answer: work cannot be queued now (answered 503)."""


def check_broker() -> None:
    """Raise BrokerUnavailable unless the broker answers: called before a request writes a row
    whose task it then sends, so that a broker that is down refuses the request and changes nothing."""
    try:
        with get_celery().connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=5)
            conn.default_channel  # noqa: B018 - opening a channel talks to the broker (Redis: PING)
    except Exception as exc:  # noqa: BLE001 - any failure to reach it is the same answer
        raise BrokerUnavailable(f"the task queue (broker) is unreachable: {exc}") from exc


def send_task(name: str, *args, queue: str = GENERAL_QUEUE, countdown: float | None = None) -> bool:
    """Send a task for a committed row (to run ``countdown`` seconds from now, if given); False (logged)
    when the broker did not take it: the row then waits for `resend_lost`, which sends it again once the
    broker is back."""
    try:
        get_celery().send_task(name, args=args, queue=queue, countdown=countdown)
    except Exception:  # noqa: BLE001 - kombu raises several kinds; the row is safe either way
        log.warning("could not send %s%s to queue %s: it will be re-sent", name, args, queue, exc_info=True)
        return False
    return True


@dataclass(frozen=True)
class Waiting:
    """A row that waits for a worker to take its task from `queue`, since `since` (its last change)."""

    task: str
    queue: str
    row_id: str
    since: datetime


def resend_lost(waiting: Iterable[Waiting], now: datetime) -> list[str]:
    """Re-send the tasks that went missing: on each queue, as many of the rows that waited longer
    than `lost_task_seconds` (oldest first) as the queue has fewer messages than waiting rows.
    Idempotent: a re-sent task counts from then on, so a later call sends nothing more for it."""
    by_queue: dict[str, list[Waiting]] = defaultdict(list)
    for row in waiting:
        by_queue[row.queue].append(row)
    cutoff = now - get_settings().lost_task_after
    long_waiting = {}
    for name, rows in by_queue.items():
        if old := sorted((r for r in rows if r.since < cutoff), key=lambda r: r.since):
            long_waiting[name] = old
    if not long_waiting:
        return []
    try:
        depths = queue_depths(list(long_waiting))
    except Exception as exc:  # noqa: BLE001 - down: nothing can be sent now, and the next beat tries again
        log.warning("the broker is unreachable (%s): lost tasks are re-sent once it is back", exc)
        return []
    sent = []
    for name, rows in long_waiting.items():
        missing = len(by_queue[name]) - depths.get(name, 0)
        for row in rows[: max(missing, 0)]:
            if send_task(row.task, row.row_id, queue=name):
                sent.append(row.row_id)
    return sent


def queue_depths(queues: list[str]) -> dict[str, int]:
    """Messages waiting in each queue (a missing queue counts as empty)."""
    depths: dict[str, int] = {}
    with get_celery().connection_for_write() as conn:
        channel = conn.default_channel
        for queue in queues:
            try:
                depths[queue] = channel.queue_declare(queue=queue, passive=True).message_count
            except Exception:  # noqa: BLE001 - passive declare of an unknown queue raises
                depths[queue] = 0
                channel = conn.channel()
    return depths
