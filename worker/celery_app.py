"""The worker's Celery app: the shared configuration plus this package's tasks and heartbeat."""

import os

from celery import signals

from app.core.config import get_settings
from app.core.db import reset_engine
from app.core.queue import make_celery
from worker.heartbeat import Heartbeat

celery = make_celery()
celery.conf.include = ["worker.tasks"]

_heartbeat: Heartbeat | None = None


@signals.worker_process_init.connect
def _init_process(**_):
    # A forked child must not share the parent's pooled DB connections.
    reset_engine()
    from worker.runs import Standby

    Standby.start()  # the first run this process takes starts training without waiting on imports


@signals.worker_ready.connect
def _start_heartbeat(sender=None, **_):
    global _heartbeat
    _heartbeat = Heartbeat(sender.hostname, os.environ.get("TUNEDECK_POOL", get_settings().pool), os.getpid())
    _heartbeat.start()


@signals.worker_shutdown.connect
def _stop_heartbeat(**_):
    if _heartbeat is not None:
        _heartbeat.stop()
