"""Engine, sessions and migrations. The database is the source of truth for every process."""

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, TypeVar

from sqlalchemy import Engine, event, update
from sqlmodel import Session, col, create_engine, select

from app.core.config import get_settings

ROOT = Path(__file__).resolve().parents[2]


def utcnow() -> datetime:
    return datetime.now(UTC)


class _Attempted(Protocol):
    """A table model whose task runs in attempts (a run, an artifact, an endpoint, a dataset, a benchmark)."""

    id: Any
    attempts: int


class _Owned(Protocol):
    """A table model that a user owns."""

    id: Any
    owner_id: int
    created_at: datetime


OwnedRow = TypeVar("OwnedRow", bound=_Owned)


class _Identified(Protocol):
    id: Any


Row = TypeVar("Row", bound=_Identified)


def locked(session: Session, model: type[Row], row_id: str) -> Row:
    """The row, read after its write lock is taken for the rest of the session's transaction (a write of
    nothing: PostgreSQL locks the row, SQLite the database), so that a read-modify-write of it cannot lose
    a concurrent one's update: the other waits, then reads what this one committed."""
    key = col(model.id)
    session.exec(update(model).where(key == row_id).values(id=key))
    return session.exec(select(model).where(key == row_id).execution_options(populate_existing=True)).one()


def claim(session: Session, row: _Attempted, **values) -> bool:
    """Take ``row`` (a run, an artifact, an endpoint, a dataset) for one more attempt: a compare-and-set
    on its ``attempts``, so that of two deliveries of the same task only one goes on. Sets ``values``
    with it; False (and nothing changed) when another took it first."""
    table = type(row)
    taken = session.exec(
        update(table)
        .where(col(table.id) == row.id, col(table.attempts) == row.attempts)
        .values(attempts=row.attempts + 1, **values)
    ).rowcount
    if not taken:
        session.rollback()
        return False
    session.commit()
    session.refresh(row)
    return True


def owned(session: Session, model: type[OwnedRow], owner, row_id: str) -> OwnedRow | None:
    """The row of ``model`` with this id, if ``owner`` owns it (else None)."""
    row = session.get(model, row_id)
    return row if row is not None and row.owner_id == owner.id else None


def owned_page(session: Session, model: type[OwnedRow], owner, *, limit: int, offset: int, **filters) -> list[OwnedRow]:
    """``owner``'s rows of ``model``, newest first, where every filter that is not None holds."""
    query = select(model).where(col(model.owner_id) == owner.id)
    for column, value in filters.items():
        if value is not None:
            query = query.where(getattr(model, column) == value)
    query = query.order_by(col(model.created_at).desc(), col(model.id).desc()).offset(offset).limit(limit)
    return list(session.exec(query).all())


@lru_cache
def get_engine() -> Engine:
    settings = get_settings()
    url = settings.sqlalchemy_url
    if url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, pool_size=20, max_overflow=20
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


def reset_engine() -> None:
    """Drop pooled connections; a forked worker child calls this before touching the DB."""
    if get_engine.cache_info().currsize:
        get_engine().dispose(close=False)
    get_engine.cache_clear()


async def get_session() -> AsyncIterator[Session]:
    """The request's session. Async on purpose: a sync generator dependency would need a free
    threadpool slot to run its cleanup, and requests waiting for a pooled connection can hold
    every slot while the connection they wait for is held by a cleanup that cannot run.
    Opening a Session connects nothing; closing it hands the connection back at once.
    Dependencies that query before the endpoint runs end their transaction (`release`), so no
    request holds a connection while it waits for a thread."""
    session = Session(get_engine(), expire_on_commit=False)
    try:
        yield session
    finally:
        session.close()


def release(session: Session) -> None:
    """End the session's transaction, handing its connection back to the pool (objects stay loaded)."""
    session.commit()


def session_scope() -> Session:
    return Session(get_engine())


def upgrade() -> None:
    """Bring the schema to the newest migration (alembic upgrade head)."""
    from alembic import command
    from alembic.config import Config

    settings = get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    cfg = Config()
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    cfg.set_main_option("sqlalchemy.url", settings.sqlalchemy_url.replace("%", "%%"))
    command.upgrade(cfg, "head")
