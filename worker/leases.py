"""A host's accelerator lease: one accelerator job at a time on a host's chips (or as many as the host
declares), so that a run, a merge's verification and a model server never share chips they each expect
to have whole.

A job takes a slot with a non-blocking ``flock`` on a file of this host (``/tmp/tunedeck-leases/<data
dir's hash>/chips-<slot>.lock``: on the host's own disk, even where the data dir is shared between hosts)
and holds it while it runs; the kernel lets go of it when the process holding it ends, however it ends.
A job that finds every slot taken does not wait in its worker slot (that would keep other work off the
worker, and the wait would show nowhere): its task says on its row what it waits for, and is sent again
a moment later (``RETRY_S``), to this host or another of its pool.

How many slots a host has: ``TUNEDECK_ACCELERATOR_JOBS``; by default 1 on an accelerator pool and no
limit on a ``cpu`` pool (CPU jobs share a host's cores as any processes do).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from sqlmodel import Session

from app.core.config import get_settings
from app.core.db import session_scope
from app.pools.models import Pool

RETRY_S = 3.0  # a job that found the chips taken is sent again this much later


class Busy(Exception):
    """Every slot of this host's chips is held: ``str()`` names the host and what holds them."""


class Lease:
    """A held slot (``release`` it, leave its ``with`` block, or let the process end)."""

    def __init__(self, fd: int | None, path: Path | None) -> None:
        self._fd, self._path = fd, path

    def release(self) -> None:
        if self._fd is not None and self._path is not None:
            self._path.with_suffix(".holder").unlink(missing_ok=True)
            os.close(self._fd)  # closing the descriptor lets go of the lock
            self._fd = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.release()


def slots() -> int | None:
    """This host's accelerator jobs at a time; None: no limit."""
    settings = get_settings()
    if settings.accelerator_jobs is not None:
        return settings.accelerator_jobs or None
    with session_scope() as session:
        pool = session.get(Pool, settings.pool)
    return None if pool is None or pool.accelerator == "cpu" else 1


def take(job: str) -> Lease:
    """A slot of this host's chips for ``job`` (what the page of a job that waits names); Busy if none
    is free."""
    count = slots()
    if count is None:
        return Lease(None, None)
    root = _root()
    holders = []
    for slot in range(count):
        path = root / f"chips-{slot}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = path.with_suffix(".holder")
            holders.append(holder.read_text() if holder.exists() else "another job")
            continue
        path.with_suffix(".holder").write_text(job)
        return Lease(fd, path)
    raise Busy(f"waiting for chips on host {socket.gethostname()}: held by {', '.join(holders)}")


def take_or_wait(job: str, wait: Callable[[Session, str, float], None]) -> Lease | None:
    """A slot of this host's chips for ``job``; or, with every slot taken, None once ``wait(session,
    why, retry_s)`` has recorded on the job's row what it waits for and sent its task again (the
    services' ``wait_for_chips``)."""
    try:
        return take(job)
    except Busy as busy:
        with session_scope() as session:
            wait(session, str(busy), RETRY_S)
        return None


def _root() -> Path:
    data_dir = str(get_settings().data_dir.resolve())
    root = Path("/tmp/tunedeck-leases") / hashlib.sha256(data_dir.encode()).hexdigest()[:12]
    root.mkdir(parents=True, exist_ok=True)
    return root
