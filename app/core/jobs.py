"""What a benchmark and an evaluation share: one task on a worker of a pool, with a heartbeat the worker
beats, a cancel flag the user sets, and a sweep that fails one whose worker went silent.

Each function takes the table (a class with the columns ``id``, ``pool``, ``status`` ("queued", "running",
then an end), ``worker``, ``attempts``, ``heartbeat_at``, ``cancel_requested``, ``error``, ``started_at``,
``finished_at`` and ``updated_at``) and a row or its id. The services (``app/benchmarks/service.py``,
``app/evaluations/service.py``) keep their own names, errors and messages, and call these."""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import update
from sqlmodel import Session, col, select

from app.core.config import get_settings
from app.core.db import claim, utcnow

Job = TypeVar("Job")


def cancel(session: Session, table: type, job: Any) -> None:
    """A queued job ends ``cancelled`` at once (its task, when it comes, finds it so); a running one is
    flagged, and its worker stops at its next beat. The flag is set in both cases: a worker that takes a
    queued one meanwhile sees it too."""
    t: Any = table
    now = utcnow()
    session.exec(update(t).where(col(t.id) == job.id).values(cancel_requested=True, updated_at=now))
    session.exec(
        update(t).where(col(t.id) == job.id, col(t.status) == "queued").values(status="cancelled", finished_at=now)
    )
    session.commit()
    session.refresh(job)


def take(session: Session, table: type[Job], job_id: str, worker: str) -> Job | None:
    """The task takes the job; None when it is not queued any more (cancelled, or taken by an earlier
    delivery of the task)."""
    job: Any = session.get(table, job_id)
    if job is None or job.status != "queued" or job.cancel_requested:
        return None
    now = utcnow()
    if not claim(session, job, status="running", worker=worker, heartbeat_at=now, started_at=now, updated_at=now):
        return None
    return job


def beat(session: Session, table: type[Job], job_id: str, worker: str) -> str | None:
    """The worker is alive. Returns why it must stop: "cancel" (the user cancelled the job), "gone" (not
    this worker's running job any more: deleted, or failed by the stale sweep while it was silent), or
    None to go on."""
    t: Any = table
    beaten = session.exec(
        update(t)
        .where(col(t.id) == job_id, col(t.status) == "running", col(t.worker) == worker)
        .values(heartbeat_at=utcnow())
    ).rowcount
    session.commit()
    if not beaten:
        return "gone"
    cancelled = session.exec(select(t.cancel_requested).where(t.id == job_id)).first()
    session.commit()
    return "cancel" if cancelled else None


def stale(session: Session, table: type[Job], pool: str) -> list[Job]:
    """The pool's running jobs whose worker has not beaten for longer than the stale bound."""
    t: Any = table
    since = utcnow() - get_settings().stale_after
    query = select(t).where(t.pool == pool, t.status == "running", col(t.heartbeat_at) < since)
    return list(session.exec(query).all())


def end(session: Session, table: type, job: Any, status: str, error: str | None, **values: Any) -> bool:
    """End a running job (with ``values`` too); False (nothing changed) when it had ended already: a worker
    that was silent too long, and failed by the stale sweep, must not write over that."""
    t: Any = table
    now = utcnow()
    ended = session.exec(
        update(t)
        .where(col(t.id) == job.id, col(t.status) == "running")
        .values(status=status, error=error, finished_at=now, updated_at=now, **values)
    ).rowcount
    session.commit()
    return bool(ended)
