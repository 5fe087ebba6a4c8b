"""One accelerator job at a time on a host (a run, a merge's verification, a model server, an evaluation):
a second job sent to a host whose chips are taken waits in the queue, saying what it waits for, and runs
once they are free."""

from datetime import datetime

from tests.api.test_artifacts import wait_artifact
from tests.api.test_endpoints import wait_endpoint
from tests.api.test_evaluations import wait_evaluation
from tests.api.test_runs_lifecycle import SMALL, demo_dataset, wait_run
from tests.conftest import start_worker, stop_worker


def test_accelerator_jobs_sent_to_one_host_run_one_after_the_other_and_the_wait_shows(server, api, tmp_path):
    r = api.post("/api/v1/pools", json={"name": "cpu-one", "accelerator": "cpu", "chips": 1, "price_per_chip_hour": 0})
    assert r.status_code == 201, r.text
    host = tmp_path / "host-one"
    # a host that declares one accelerator job at a time, with two worker slots (so both tasks are taken)
    worker = start_worker(server, host, "cpu-one", name="host-one", env={"TUNEDECK_ACCELERATOR_JOBS": "1"})
    try:
        server.wait_for(lambda: api.get("/api/v1/pools/cpu-one").json()["workers_online"] == 1, timeout=90)
        dataset = demo_dataset(server, api)
        body = {"dataset_id": dataset, "pool": "cpu-one", "config": {**SMALL, "max_steps": 10}}
        first = api.post("/api/v1/runs", json=body).json()["id"]
        server.wait_for(lambda: api.get(f"/api/v1/runs/{first}").json()["status"] == "running", timeout=60)
        second = api.post("/api/v1/runs", json=body).json()["id"]

        # While the first trains, the second stays queued and says why.
        def waiting():
            run = api.get(f"/api/v1/runs/{second}").json()
            return run if run["phase"] == "waiting for chips" else None

        shown = server.wait_for(waiting, timeout=30, what="the second run to wait for the chips")
        assert shown["status"] == "queued" and api.get(f"/api/v1/runs/{first}").json()["status"] == "running"
        events = [e["message"] for e in api.get(f"/api/v1/runs/{second}/events").json()["data"]]
        assert [m for m in events if m.startswith("waiting for chips on host ")] == [
            next(m for m in events if m.startswith("waiting for chips on host "))
        ], "said once, however many times its task came back"
        assert any(m.endswith(f": held by run {first}") for m in events), events

        a, b = wait_run(server, api, first), wait_run(server, api, second)
        assert (a["status"], b["status"]) == ("succeeded", "succeeded"), (a["error"], b["error"])
        assert datetime.fromisoformat(b["started_at"]) >= datetime.fromisoformat(a["finished_at"])
        assert b["attempts"] == 1  # waiting took no attempt

        # A model server holds the chips while it serves: a second endpoint waits for them, saying so, and
        # starts once the first stops. (The runs' merges held them too: their verification runs the model.)
        merged = {}
        for run in (a, b):
            (art,) = api.get("/api/v1/artifacts", params={"run_id": run["id"]}).json()["data"]
            merged[run["id"]] = wait_artifact(server, api, art["id"])
            assert merged[run["id"]]["status"] == "succeeded", merged[run["id"]]["error"]
        deploy = {"pool": "cpu-one", "max_model_len": 256, "max_num_seqs": 4}
        e1 = api.post("/api/v1/endpoints", json={"artifact_id": merged[first]["id"], **deploy}).json()
        assert wait_endpoint(server, api, e1["id"], ("ready", "failed"))["status"] == "ready"
        e2 = api.post("/api/v1/endpoints", json={"artifact_id": merged[second]["id"], **deploy}).json()

        def e2_waits():
            e = api.get(f"/api/v1/endpoints/{e2['id']}").json()
            return e if e["phase"] == "waiting for chips" else None

        shown = server.wait_for(e2_waits, timeout=30, what="the second endpoint to wait for the chips")
        assert shown["status"] == "pending" and shown["waiting"].endswith(f": held by endpoint {e1['id']}"), shown
        api.post(f"/api/v1/endpoints/{e1['id']}/stop")
        assert wait_endpoint(server, api, e1["id"], ("stopped", "failed"))["status"] == "stopped"
        assert wait_endpoint(server, api, e2["id"], ("ready", "failed"))["status"] == "ready"

        # An evaluation serves its subjects on the chips too: it waits while the endpoint holds them.
        body = {
            "dataset_id": dataset,
            "subjects": [{"kind": "base", "run_id": first}],
            "metrics": ["chrf"],
            "max_samples": 2,
            "max_tokens": 4,
        }
        ev = api.post("/api/v1/evaluations", json=body).json()

        def ev_waits():
            e = api.get(f"/api/v1/evaluations/{ev['id']}").json()
            return e if (e["phase"] or "").startswith("waiting for chips on host ") else None

        shown = server.wait_for(ev_waits, timeout=30, what="the evaluation to wait for the chips")
        assert shown["status"] == "queued" and shown["phase"].endswith(f": held by endpoint {e2['id']}"), shown
        api.post(f"/api/v1/endpoints/{e2['id']}/stop")
        wait_endpoint(server, api, e2["id"], ("stopped", "failed"))
        done = wait_evaluation(server, api, ev["id"])
        assert done["status"] == "succeeded", done["error"]
    finally:
        stop_worker(worker, host)
