"""Benchmarks: load sent to a ready endpoint by a worker of its pool, with `vllm bench serve`'s
definitions: a sweep over concurrency with random prompts, Poisson arrivals with a dataset's prompts;
results stored, listed by endpoint, priced per million output tokens; bad requests named."""

from datetime import UTC, datetime

import pytest

from tests.api.test_endpoints import wait_endpoint

LOAD = {"num_prompts": 8, "input_len": 24, "output_len": 8}


@pytest.fixture(scope="module")
def endpoint(server, api, artifact):
    r = api.post("/api/v1/endpoints", json={"artifact_id": artifact["id"], "max_model_len": 256, "max_num_seqs": 4})
    assert r.status_code == 201, r.text
    ep = wait_endpoint(server, api, r.json()["id"], ("ready", "failed"))
    assert ep["status"] == "ready", ep["error"]
    yield ep
    api.post(f"/api/v1/endpoints/{ep['id']}/stop")
    wait_endpoint(server, api, ep["id"], ("stopped", "failed"), timeout=60)


def wait_benchmark(server, api, benchmark_id: str) -> dict:
    def done():
        b = api.get(f"/api/v1/benchmarks/{benchmark_id}").json()
        return b if b["status"] in ("succeeded", "failed") else None

    return server.wait_for(done, timeout=180, interval=0.3, what=f"benchmark {benchmark_id}")


def test_a_concurrency_sweep_measures_latency_and_throughput(server, api, endpoint):
    api.patch("/api/v1/pools/cpu", json={"price_per_chip_hour": 1.5})
    try:
        r = api.post("/api/v1/benchmarks", json={"endpoint_id": endpoint["id"], "concurrency": [4, 1], **LOAD})
    finally:
        api.patch("/api/v1/pools/cpu", json={"price_per_chip_hour": 0.0})
    assert r.status_code == 201, r.text
    bench = r.json()
    assert bench["status"] == "queued" and bench["requests_total"] == 16 and bench["model"] == endpoint["model"]
    assert bench["config"]["concurrency"] == [1, 4] and bench["config"]["request_rates"] == []

    bench = wait_benchmark(server, api, bench["id"])
    assert bench["status"] == "succeeded", bench["error"]
    assert bench["requests_done"] == 16 and bench["price_per_chip_hour"] == 1.5
    assert [level["concurrency"] for level in bench["results"]] == [1, 4]
    for level in bench["results"]:
        assert level["completed"] == 8 and level["failed"] == 0 and level["errors"] == []
        assert level["output_tokens"] == 8 * 8  # every reply goes on to output_len (end-of-sequence ignored)
        assert level["input_tokens"] >= 8 * 20  # random prompts of about input_len tokens
        duration = level["duration_s"]
        assert level["request_throughput"] == pytest.approx(8 / duration)
        assert level["output_throughput"] == pytest.approx(64 / duration)
        assert level["total_token_throughput"] == pytest.approx((level["input_tokens"] + 64) / duration)
        for stat in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            s = level[stat]
            assert 0 < s["median"] <= s["p99"] and s["mean"] > 0, (stat, s)
        assert level["ttft_ms"]["mean"] < level["e2el_ms"]["mean"] <= duration * 1000
        # the cpu pool at 1.5 USD per chip-hour, one chip, at this output throughput
        assert level["usd_per_million_output_tokens"] == pytest.approx(1.5 / (level["output_throughput"] * 3600) * 1e6)

    listed = api.get("/api/v1/benchmarks", params={"endpoint_id": endpoint["id"]}).json()
    assert bench["id"] in [b["id"] for b in listed["data"]]


def test_poisson_arrivals_with_a_datasets_prompts(server, api, endpoint, trained_run):
    body = {
        "endpoint_id": endpoint["id"],
        "mode": "rate",
        "request_rates": [20],
        "max_concurrency": 2,
        "dataset_id": trained_run["dataset_id"],
        **LOAD,
    }
    r = api.post("/api/v1/benchmarks", json=body)
    assert r.status_code == 201, r.text
    assert r.json()["config"]["concurrency"] == []
    bench = wait_benchmark(server, api, r.json()["id"])
    assert bench["status"] == "succeeded", bench["error"]
    (level,) = bench["results"]
    assert level["request_rate"] == 20 and level["concurrency"] is None
    assert level["completed"] == 8 and level["output_tokens"] == 64
    assert level["usd_per_million_output_tokens"] == 0  # the cpu pool is free


def test_bad_benchmarks_are_named_and_a_benchmark_can_be_deleted(server, api, endpoint, artifact):
    def refused(body: dict, field: str, text: str, code: int = 422):
        r = api.post("/api/v1/benchmarks", json={"endpoint_id": endpoint["id"], **body})
        assert r.status_code == code, r.text
        assert r.json()["detail"][0]["loc"] == ["body", field] and text in r.json()["detail"][0]["msg"], r.text

    refused({"concurrency": [0, 4]}, "concurrency", "each from 1 to 4096")
    refused({"mode": "rate", "request_rates": [-1]}, "request_rates", "above 0")
    refused({"num_prompts": 0}, "num_prompts", "greater than or equal to 1")
    refused({"dataset_id": "ds-nope"}, "dataset_id", "unknown dataset 'ds-nope'")
    refused({"endpoint_id": "ep-nope"}, "endpoint_id", "unknown endpoint 'ep-nope'")

    r = api.post("/api/v1/endpoints", json={"artifact_id": artifact["id"]})
    stopped = api.post(f"/api/v1/endpoints/{r.json()['id']}/stop").json()
    assert stopped["status"] == "stopped"
    refused({"endpoint_id": stopped["id"]}, "endpoint_id", "is stopped; benchmark a ready one")

    before = api.get("/api/v1/benchmarks").json()["count"]
    r = api.post("/api/v1/benchmarks", json={"endpoint_id": endpoint["id"], "concurrency": [2], **LOAD})
    bench = wait_benchmark(server, api, r.json()["id"])
    assert api.get("/api/v1/benchmarks").json()["count"] == before + 1
    assert api.delete(f"/api/v1/benchmarks/{bench['id']}").status_code == 204
    assert api.get(f"/api/v1/benchmarks/{bench['id']}").status_code == 404
    assert api.get("/api/v1/benchmarks").json()["count"] == before


def test_an_endpoint_and_its_run_cost_their_pools_chip_hours(server, api, endpoint, trained_run):
    api.patch("/api/v1/pools/cpu", json={"price_per_chip_hour": 3600.0})  # one chip: a dollar a second
    try:
        ep = api.get(f"/api/v1/endpoints/{endpoint['id']}").json()
        cost = api.get(f"/api/v1/runs/{trained_run['id']}/cost").json()
    finally:
        api.patch("/api/v1/pools/cpu", json={"price_per_chip_hour": 0.0})
    up = (datetime.now(UTC) - datetime.fromisoformat(ep["started_at"])).total_seconds()
    assert ep["cost_usd"] == pytest.approx(up, abs=2)
    trained = datetime.fromisoformat(trained_run["finished_at"]) - datetime.fromisoformat(trained_run["started_at"])
    assert cost["training_usd"] == pytest.approx(trained.total_seconds(), abs=0.01)
    (mine,) = [e for e in cost["endpoints"] if e["id"] == endpoint["id"]]
    assert mine["cost_usd"] >= ep["cost_usd"] and mine["pool"] == "cpu"
    assert cost["serving_usd"] >= mine["cost_usd"]
    assert cost["total_usd"] == pytest.approx(cost["training_usd"] + cost["serving_usd"], abs=1e-5)
