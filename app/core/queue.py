"""The Celery application as both sides see it.

The web process only *sends* tasks, by name (it never imports worker code); `worker/` registers
the tasks under the same names. Every worker consumes its pool's queue and the shared `general`
queue.
"""

from functools import lru_cache

from celery import Celery

from app.core.config import get_settings

GENERAL_QUEUE = "general"

# Task names: the contract between app/ (sender) and worker/ (implementer).
VALIDATE_DATASET = "tunedeck.datasets.validate"
TRAIN_RUN = "tunedeck.runs.train"
BUILD_ARTIFACT = "tunedeck.artifacts.build"
START_ENDPOINT = "tunedeck.endpoints.start"
RUN_BENCHMARK = "tunedeck.benchmarks.run"


def make_celery() -> Celery:
    settings = get_settings()
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
        # Tasks are acknowledged late; Redis would hand a task that is still running (a long
        # training) to another worker after this long. Lost workers are noticed by heartbeat.
        celery.conf.broker_transport_options = {"visibility_timeout": 7 * 24 * 3600}
    return celery


@lru_cache
def get_celery() -> Celery:
    return make_celery()


def send_task(name: str, *args, queue: str = GENERAL_QUEUE) -> None:
    get_celery().send_task(name, args=args, queue=queue)


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
