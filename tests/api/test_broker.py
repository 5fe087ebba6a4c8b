"""The broker is down, or loses messages (a Redis without persistence restarted, a list deleted):
work that cannot be queued is refused with 503 and nothing is written, and rows whose task went
missing get it again from the workers' beats, once, however long they wait. A Redis of its own, so the
test can stop and restart it."""

import subprocess
import time

import pytest
import redis

from tests.api.test_runs_validation import CHAT
from tests.conftest import free_port, start_server, stop_server, upload, wait_dataset

POOL = "parked"  # a pool with no worker: its messages stay in its queue, where the test can see them


@pytest.fixture
def own_redis(tmp_path):
    port = free_port()
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]

    def start():
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL)
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                return proc
            except redis.ConnectionError:
                time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    procs = [start()]
    yield port, procs, start
    for proc in procs:
        proc.kill()
        proc.wait()


def lost_upload(server, dataset_id: str) -> str:
    """A copy of a validated upload's row, back to `validating` as if its task had been lost on the
    way to the broker a while ago."""
    (row,) = server.sql("SELECT * FROM datasets WHERE id = :id", id=dataset_id)
    columns = [c for c in row._fields if c not in ("id", "status", "attempts", "updated_at")]
    lost = dataset_id[:-4] + "lost"
    server.sql(
        f"INSERT INTO datasets (id, status, attempts, updated_at, {', '.join(columns)}) "
        f"SELECT :lost, 'validating', 0, :old, {', '.join(columns)} FROM datasets WHERE id = :id",
        lost=lost,
        old="2000-01-01 00:00:00",
        id=dataset_id,
    )
    return lost


def test_a_down_broker_refuses_work_and_lost_tasks_are_sent_again(tmp_path, own_redis):
    port, procs, start_redis = own_redis
    broker = redis.Redis(port=port)
    server = start_server(
        tmp_path / "srv",
        {"TUNEDECK_BROKER_URL": f"redis://127.0.0.1:{port}/0", "TUNEDECK_LOST_TASK_SECONDS": "2"},
    )
    try:
        api = server.client()
        pool = {"name": POOL, "accelerator": "cpu", "chips": 1, "price_per_chip_hour": 1}
        assert api.post("/api/v1/pools", json=pool).status_code == 201
        dataset = wait_dataset(server, api, upload(api, "chat.jsonl", CHAT).json()["id"])["id"]
        run = {"base_model": "tiny-gemma4", "dataset_id": dataset, "pool": POOL}
        first = api.post("/api/v1/runs", json=run)
        assert first.status_code == 201, first.text
        assert broker.llen(POOL) == 1

        broker.delete(POOL)  # the message is lost
        server.wait_for(lambda: broker.llen(POOL) == 1, timeout=15, what="the lost task sent again")
        time.sleep(4)  # several beats later: sent once, not once per beat
        assert broker.llen(POOL) == 1

        lost = lost_upload(server, dataset)  # an upload whose validation task never reached the broker
        assert wait_dataset(server, api, lost)["status"] == "ready"

        procs[0].terminate()  # the broker goes down
        procs[0].wait()
        runs = api.get("/api/v1/runs").json()["count"]
        datasets = api.get("/api/v1/datasets").json()["count"]
        files = sorted(server.data_dir.rglob("*"))
        refused = api.post("/api/v1/runs", json=run)
        assert refused.status_code == 503 and "broker" in refused.json()["detail"], refused.text
        refused = upload(api, "chat.jsonl", CHAT)
        assert refused.status_code == 503 and "nothing was changed" in refused.json()["detail"]
        refused = api.post("/v1/fine_tuning/jobs", json={"model": "tiny-gemma4", "training_file": dataset})
        assert refused.status_code == 503 and "broker" in refused.json()["error"]["message"]
        assert api.get("/api/v1/runs").json()["count"] == runs
        assert api.get("/api/v1/datasets").json()["count"] == datasets
        assert sorted(server.data_dir.rglob("*")) == files, "no upload left behind"

        procs.append(start_redis())  # back, empty: it kept nothing on disk
        second = api.post("/api/v1/runs", json=run)
        assert second.status_code == 201, second.text
        # the first run's task went with the old broker's memory: sent again
        server.wait_for(lambda: broker.llen(POOL) == 2, timeout=15, what="the first run's task sent again")
        time.sleep(4)
        assert broker.llen(POOL) == 2
        queued = {r["id"]: r["status"] for r in api.get("/api/v1/runs").json()["data"]}
        assert queued[first.json()["id"]] == queued[second.json()["id"]] == "queued"
    finally:
        stop_server(server)
