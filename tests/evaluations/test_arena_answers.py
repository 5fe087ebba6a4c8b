"""Both sides of an arena battle stream at once, and each keeps its answer with the battle when it ends:
two answers kept at the same moment must both stay (a read-modify-write of the battle's answers lost
one of them, and the vote then found that side unanswered)."""

import os
import threading

import pytest
from sqlmodel import select

from app.arena.models import Battle
from app.arena.service import _keep
from app.auth.models import User
from app.core import db
from app.core.config import get_settings
from tests.conftest import _fresh_postgres

TRIALS = 40


@pytest.fixture
def database(tmp_path, monkeypatch):
    """A migrated database of the test's own (SQLite; PostgreSQL with TUNEDECK_TEST_DATABASE_URL), with one user."""
    monkeypatch.setenv("TUNEDECK_DATA_DIR", str(tmp_path))
    if os.environ.get("TUNEDECK_TEST_DATABASE_URL"):
        monkeypatch.setenv("TUNEDECK_DATABASE_URL", _fresh_postgres(os.environ["TUNEDECK_TEST_DATABASE_URL"]))
    get_settings.cache_clear()
    db.reset_engine()
    db.upgrade()
    with db.session_scope() as session:
        session.add(User(username="u", hashed_password="x"))
        session.commit()
    yield
    db.reset_engine()
    get_settings.cache_clear()


def test_two_answers_kept_at_once_are_both_kept(database):
    with db.session_scope() as session:
        owner = session.exec(select(User)).one().id
        for i in range(TRIALS):
            session.add(Battle(id=f"b-{i}", owner_id=owner, messages=[], sides=[], max_tokens=8))
        session.commit()
    for i in range(TRIALS):
        start = threading.Barrier(2)

        def keep(side: str, battle_id: str = f"b-{i}", start: threading.Barrier = start) -> None:
            start.wait()
            _keep(battle_id, side, f"answer {side}")

        threads = [threading.Thread(target=keep, args=(side,)) for side in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    with db.session_scope() as session:
        kept = {b.id: b.outputs for b in session.exec(select(Battle))}
    lost = [battle_id for battle_id, outputs in kept.items() if outputs != {"a": "answer a", "b": "answer b"}]
    assert not lost, f"{len(lost)} of {TRIALS} battles lost an answer: {kept[lost[0]]}"
