"""Artifacts of a run: the merged checkpoint made when it succeeds, PEFT adapters on demand,
verification, downloads with range requests, deletion, a killed build re-queued."""

import hashlib
import os
import signal

from tests.api.conftest import TINY_RUN
from tests.api.test_endpoints import model_server, wait_endpoint
from tests.api.test_runs_lifecycle import demo_dataset, running_with, wait_run, worker_tree
from tests.conftest import make_user, start_server, start_worker, stop_server, stop_worker


def wait_artifact(server, client, artifact_id: str, timeout: float = 300) -> dict:
    def done():
        a = client.get(f"/api/v1/artifacts/{artifact_id}").json()
        return a if a["status"] in ("succeeded", "failed") else None

    return server.wait_for(done, timeout=timeout, interval=0.5, what=f"artifact {artifact_id}")


def test_a_succeeded_run_gets_its_merged_model_verified(server, api, trained_run):
    run = trained_run
    # the merge made when it succeeded (an evaluation may have merged an earlier checkpoint since)
    listed = api.get("/api/v1/artifacts", params={"run_id": run["id"]}).json()["data"]
    (listed,) = [a for a in listed if a["kind"] == "merged" and a["checkpoint_step"] == TINY_RUN["max_steps"]]
    art = wait_artifact(server, api, listed["id"])
    assert art["status"] == "succeeded", (art["error"], server.log()[-3000:])
    assert (art["kind"], art["checkpoint_step"], art["name"]) == ("merged", 6, run["fine_tuned_model"])
    names = {f["path"] for f in art["files"]}
    assert {"model.safetensors", "config.json", "tokenizer.json", "manifest.json"} <= names
    assert art["size_bytes"] == sum(f["size"] for f in art["files"]) and art["bytes_done"] > 0
    v = art["verification"]
    assert v["passed"] and v["max_abs_diff"] < 1e-4 and v["argmax_agreement"] == 1.0, v

    # Downloads stream the listed bytes; a range request gets just the range.
    weights = next(f for f in art["files"] if f["path"] == "model.safetensors")
    body = api.get(f"/api/v1/artifacts/{art['id']}/files/model.safetensors").content
    assert len(body) == weights["size"] and hashlib.sha256(body).hexdigest() == weights["sha256"]
    r = api.get(f"/api/v1/artifacts/{art['id']}/files/model.safetensors", headers={"Range": "bytes=100-199"})
    assert r.status_code == 206 and r.content == body[100:200]
    assert api.get(f"/api/v1/artifacts/{art['id']}/files/../../server.log").status_code == 404


def test_adapter_export_of_an_earlier_checkpoint_and_bad_requests(server, api, trained_run):
    run = trained_run
    r = api.post("/api/v1/artifacts", json={"run_id": run["id"], "kind": "adapter", "checkpoint_step": 3})
    assert r.status_code == 201, r.text
    art = wait_artifact(server, api, r.json()["id"])
    assert art["status"] == "succeeded", (art["error"], server.log()[-3000:])
    assert {f["path"] for f in art["files"]} == {"adapter_config.json", "adapter_model.safetensors", "manifest.json"}
    assert art["name"] == f"{run['fine_tuned_model']}:step-3:adapter"
    again = api.post("/api/v1/artifacts", json={"run_id": run["id"], "kind": "adapter", "checkpoint_step": 3})
    assert again.status_code == 409 and art["id"] in again.text

    # The run cannot be deleted while artifacts made from it exist: the answer names them all.
    made = [a["id"] for a in api.get("/api/v1/artifacts", params={"run_id": run["id"]}).json()["data"]]
    assert art["id"] in made and len(made) >= 2
    r = api.delete(f"/api/v1/runs/{run['id']}")
    assert r.status_code == 409 and all(a in r.json()["detail"] for a in made), r.text
    assert "delete them first" in r.json()["detail"]
    assert api.get(f"/api/v1/runs/{run['id']}/checkpoints").json()["count"] == 2  # nothing was deleted

    for body, field in (
        ({"run_id": "run-nope"}, "run_id"),
        ({"run_id": run["id"], "checkpoint_step": 4}, "checkpoint_step"),
        ({"run_id": run["id"], "kind": "gguf"}, "kind"),
    ):
        r = api.post("/api/v1/artifacts", json=body)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == field, r.text
    _, _, token = make_user(server)
    other = server.client(token)
    assert other.get(f"/api/v1/artifacts/{art['id']}").status_code == 404
    assert other.post("/api/v1/artifacts", json={"run_id": run["id"]}).status_code == 422
    assert other.get("/api/v1/artifacts").json()["count"] == 0

    assert api.delete(f"/api/v1/artifacts/{art['id']}").status_code == 204
    assert api.get(f"/api/v1/artifacts/{art['id']}").status_code == 404
    assert not (server.data_dir / "artifacts" / art["id"]).exists()


def test_a_killed_build_is_requeued_and_lands_in_the_artifact_store(tmp_path_factory):
    """A build whose worker is SIGKILLed mid-way is noticed by its silence, re-queued, and built again.
    With TUNEDECK_ARTIFACT_STORE (gs://... in production; a file:// URL here, through the same fsspec
    code), finished artifacts are uploaded there and streamed back through the API."""
    store = tmp_path_factory.mktemp("store")
    server = start_server(
        tmp_path_factory.mktemp("tunedeck-store"),
        {"TUNEDECK_ARTIFACT_STORE": f"file://{store}", "TUNEDECK_STALE_SECONDS": "4"},
    )
    try:
        api = server.client()
        dataset = demo_dataset(server, api)
        config = {**TINY_RUN, "max_steps": 3}
        run = wait_run(
            server, api, api.post("/api/v1/runs", json={"dataset_id": dataset, "config": config}).json()["id"]
        )
        assert run["status"] == "succeeded", (run["error"], server.log()[-3000:])
        (art,) = api.get("/api/v1/artifacts", params={"run_id": run["id"]}).json()["data"]

        def building():
            return running_with(server, "worker.artifacts")

        server.wait_for(building, timeout=120, interval=0.05, what="the build process")
        assert api.get(f"/api/v1/artifacts/{art['id']}").json()["status"] == "running"
        for proc in worker_tree(server):
            os.kill(proc.pid, signal.SIGKILL)

        art = wait_artifact(server, api, art["id"])
        assert art["status"] == "succeeded", (art["error"], server.log()[-3000:])
        assert art["attempts"] == 2 and art["verification"]["passed"], art
        assert art["path"] == f"file://{store}/{art['id']}"
        stored = {p.name: p for p in (store / art["id"]).iterdir()}
        assert set(stored) == {f["path"] for f in art["files"]}
        assert not (server.data_dir / "artifacts" / art["id"]).exists()  # the local build was freed
        data = stored["model.safetensors"].read_bytes()
        url = f"/api/v1/artifacts/{art['id']}/files/model.safetensors"
        whole = api.get(url)
        assert whole.status_code == 200 and whole.content == data and whole.headers["accept-ranges"] == "bytes"
        part = api.get(url, headers={"Range": "bytes=-64"})
        assert part.status_code == 206 and part.content == data[-64:]
        assert part.headers["content-range"] == f"bytes {len(data) - 64}-{len(data) - 1}/{len(data)}"
        assert api.get(url, headers={"Range": f"bytes={len(data)}-"}).status_code == 416

        # Host B (its own data dir; A's out of its sight) copies it from the store's URL, as from gs://.
        host_b = server.data_dir.parent / f"{server.data_dir.name}-host-b"
        stopped = serve_on_another_host(server, api, art, host_b, [server.data_dir / "artifacts"])
        assert stopped["status"] == "stopped", stopped["error"]
        assert api.delete(f"/api/v1/artifacts/{art['id']}").status_code == 204
        assert not (store / art["id"]).exists()
    finally:
        stop_server(server)


def serve_on_another_host(server, api, artifact: dict, host_dir, hidden: list) -> dict:
    """Deploy ``artifact`` on a worker of its own pool, "host B" (its own data dir; ``hidden`` out of its
    sight), and check that it serves from that host's copy, checked file by file. Returns the endpoint."""
    r = api.post("/api/v1/pools", json={"name": "cpu-b", "accelerator": "cpu", "chips": 1, "price_per_chip_hour": 0})
    assert r.status_code in (201, 409), r.text
    worker = start_worker(server, host_dir, "cpu-b", hidden=hidden)
    try:
        server.wait_for(
            lambda: api.get("/api/v1/pools/cpu-b").json()["workers_online"] >= 1, timeout=90, what="host B's worker"
        )
        r = api.post(
            "/api/v1/endpoints",
            json={"artifact_id": artifact["id"], "pool": "cpu-b", "max_model_len": 256, "max_num_seqs": 4},
        )
        assert r.status_code == 201, r.text
        endpoint = wait_endpoint(server, api, r.json()["id"], ("ready", "failed"))
        log = (host_dir / "worker.log").read_text(errors="replace")[-3000:]
        assert endpoint["status"] == "ready", (endpoint["error"], log)

        # Host B serves its own copy, every file as the manifest lists it.
        copy = host_dir / "cache" / "artifacts" / artifact["id"]
        command = model_server(endpoint).cmdline()
        assert command[command.index("--model") + 1] == str(copy)
        for f in artifact["files"]:
            assert hashlib.sha256((copy / f["path"]).read_bytes()).hexdigest() == f["sha256"], f["path"]
        r = api.post(
            "/v1/chat/completions",
            json={"model": endpoint["model"], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text
        api.post(f"/api/v1/endpoints/{endpoint['id']}/stop")
        return wait_endpoint(server, api, endpoint["id"], ("stopped", "failed"))
    finally:
        stop_worker(worker, host_dir)


def test_an_artifact_built_on_one_host_is_served_on_another(server, api, artifact, tmp_path):
    """Built by host A's worker in A's data dir; deployed on host B, which cannot see A's data dir: B copies
    it from the web app (a credential signed with the deployment's secret; without one, 403)."""
    assert artifact["path"] == str(server.data_dir / "artifacts" / artifact["id"])
    url = f"/internal/artifacts/{artifact['id']}/files/model.safetensors"
    for headers in ({}, {"X-Tunedeck-Worker-Token": "forged"}):
        r = server.anonymous().get(url, headers=headers)
        assert r.status_code == 403 and "TUNEDECK_SECRET_KEY" in r.json()["detail"], r.text
    stopped = serve_on_another_host(server, api, artifact, tmp_path / "host-b", [server.data_dir / "artifacts"])
    assert stopped["status"] == "stopped", stopped["error"]
