"""A thread that beats a row's heartbeat while its worker does long work (a benchmark's load, an
evaluation's questions) on an event loop that must not wait on the database."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlmodel import Session

from app.core.db import session_scope

HEARTBEAT_S = 1.0  # also how soon a cancel is seen

log = logging.getLogger(__name__)


class Beat:
    """Calls ``heartbeat(session, row_id, worker)`` every ``HEARTBEAT_S`` with a session of its own. It
    answers why the work must stop ("cancel": the user cancelled it; "gone": it is not this worker's
    running row any more) or None; on an answer, ``stop`` is set and ``reason`` says it."""

    def __init__(self, heartbeat: Callable[[Session, str, str], str | None], row_id: str, worker: str) -> None:
        self.heartbeat, self.row_id, self.worker = heartbeat, row_id, worker
        self.stop = threading.Event()
        self.reason: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{row_id}", daemon=True)

    def __enter__(self) -> Beat:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._done.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with session_scope() as session:
            while not self._done.wait(HEARTBEAT_S):
                try:
                    reason = self.heartbeat(session, self.row_id, self.worker)
                except Exception:  # noqa: BLE001 - a missed beat is retried; a long silence fails it
                    log.exception("%s: heartbeat failed", self.row_id)
                    session.rollback()
                    continue
                if reason is not None:
                    self.reason = reason
                    self.stop.set()
                    return
