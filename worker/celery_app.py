"""The worker's Celery app: the shared configuration plus this package's tasks and heartbeat."""

import logging
import os
import threading

from celery import signals

from app.core.config import get_settings
from app.core.db import reset_engine, session_scope
from app.core.queue import make_celery
from worker.heartbeat import Heartbeat

celery = make_celery()
celery.conf.include = ["worker.tasks"]

_heartbeat: Heartbeat | None = None
log = logging.getLogger(__name__)


@signals.worker_process_init.connect
def _init_process(**_):
    # A forked child must not share the parent's pooled DB connections.
    reset_engine()
    if get_settings().training_standby:
        from worker.runs import Standby

        Standby.start()  # the first run this process takes starts training without waiting on imports


@signals.worker_ready.connect
def _start_heartbeat(sender, **_):  # Celery sends every signal with its sender
    global _heartbeat
    settings = get_settings()
    # a slice pool's worker: its place, as `tunedeck worker` found it (both set, or neither)
    place = (
        (settings.slice, settings.host_index)
        if settings.slice is not None and settings.host_index is not None
        else None
    )
    _heartbeat = Heartbeat(sender.hostname, settings.pool, os.getpid(), place)
    _heartbeat.start()


@signals.worker_shutdown.connect
def _on_shutdown(sender, **_):
    if _heartbeat is not None:
        _heartbeat.stop()
    # Its runs handed back (_hand_back_runs) go on the queue now that this worker takes no more tasks.
    from app.runs import service as runs

    with session_scope() as session:
        runs.requeue_handed_back(session, sender.hostname)


@signals.worker_shutting_down.connect
def _hand_back_runs(sender: str, **_):  # the worker's hostname
    """Stopping (SIGTERM, Ctrl-C): this worker's runs save a checkpoint and stop while Celery waits for
    their tasks, to be queued again when it has stopped (_on_shutdown), instead of lost and re-queued
    only once found silent. Called in a signal handler: the database work runs in a thread of its own."""

    def hand_back():
        from app.runs import service as runs

        try:
            with session_scope() as session:
                for run_id in runs.hand_back(session, sender):
                    log.info("handing run %s back to the queue", run_id)
        except Exception:  # noqa: BLE001 - a lost worker's runs are still re-queued when found silent
            log.exception("could not hand this worker's runs back")

    thread = threading.Thread(target=hand_back, name="hand-back")
    thread.start()
    thread.join(timeout=10)
