"""The embedded broker (kombu's SQLAlchemy transport over SQLite) as several workers share it: two
workers of a slice start together and declare the same queues, and a worker's beat measures queue
depths every few seconds for as long as it lives."""

import gc
import sqlite3

import pytest
from sqlalchemy import event

from app.core import queue
from app.core.config import get_settings


@pytest.fixture
def broker_url(tmp_path, monkeypatch):
    """The app's Celery on a broker of this test's own (the same transport as the embedded default's)."""
    url = f"sqla+sqlite:///{tmp_path / 'broker.db'}"
    monkeypatch.setenv("TUNEDECK_BROKER_URL", url)
    get_settings.cache_clear()
    queue.get_celery.cache_clear()
    yield url
    queue.get_celery.cache_clear()
    get_settings.cache_clear()


def connection():
    return queue.get_celery().connection_for_write()


def test_a_queue_another_worker_declares_at_the_same_moment_is_taken_not_a_crash(broker_url, tmp_path):
    # Set up the tables and a first queue, as a worker that started earlier would have.
    with connection() as conn:
        conn.default_channel.queue_declare(queue="general")
        engine = conn.default_channel.session.get_bind()

    # The other host's worker inserts "cpu-slice" between this worker's look-up (none yet) and its
    # insert: the moment two workers of a slice, started together, both found the queue missing.
    def the_other_host_declares_it_first(conn, cursor, statement, parameters, context, executemany):
        if statement.startswith("INSERT INTO kombu_queue") and parameters[0] == "cpu-slice":
            other = sqlite3.connect(tmp_path / "broker.db")
            other.execute("INSERT INTO kombu_queue (name) VALUES ('cpu-slice')")
            other.commit()
            other.close()

    event.listen(engine, "before_cursor_execute", the_other_host_declares_it_first)
    try:
        with connection() as conn:
            conn.default_channel.queue_declare(queue="cpu-slice")
            conn.default_channel.basic_publish(
                conn.default_channel.prepare_message("hello"), exchange="", routing_key="cpu-slice"
            )
            assert conn.default_channel.queue_declare(queue="cpu-slice", passive=True).message_count == 1
    finally:
        event.remove(engine, "before_cursor_execute", the_other_host_declares_it_first)
    names = [row[0] for row in sqlite3.connect(tmp_path / "broker.db").execute("SELECT name FROM kombu_queue")]
    assert sorted(names) == ["cpu-slice", "general"]


def test_measuring_queue_depths_holds_no_database_connection_after(broker_url):
    with connection() as conn:
        engine = conn.default_channel.session.get_bind()
    gc.disable()  # a worker idles for minutes between collections: nothing may wait for one
    try:
        for _ in range(20):  # more than the engine's pool (5 + 10 overflow) holds
            assert queue.queue_depths(["general", "cpu-slice"]) == {"general": 0, "cpu-slice": 0}
            assert engine.pool.checkedout() == 0
    finally:
        gc.enable()
