"""A worker's heartbeat survives a beat that fails, the first one included: a worker that starts while
its database is unreachable (here: not migrated yet) comes online once it answers."""

import time

import pytest
from sqlmodel import Session

from app.core.config import get_settings
from app.core.db import get_engine, reset_engine, upgrade
from app.pools.models import WorkerHost
from worker.heartbeat import Heartbeat


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEDECK_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("TUNEDECK_DATABASE_URL", raising=False)
    monkeypatch.setenv("TUNEDECK_WORKER_HEARTBEAT_SECONDS", "0.1")
    get_settings.cache_clear()
    reset_engine()
    yield tmp_path
    reset_engine()
    get_settings.cache_clear()


def test_a_first_beat_that_fails_does_not_stop_the_heartbeat(data_dir):
    heartbeat = Heartbeat("host-a", "cpu", 4242)
    heartbeat.start()  # no tables yet: the first beat fails
    try:
        upgrade()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with Session(get_engine()) as session:
                host = session.get(WorkerHost, "host-a")
            if host is not None:
                break
            time.sleep(0.05)
        assert host is not None and host.pid == 4242 and host.pool == "cpu"
    finally:
        heartbeat.stop()
