"""Benchmarks: load sent to a ready endpoint by a worker of its pool, with `vllm bench serve`'s
definitions: a sweep over concurrency with random prompts, Poisson arrivals with a dataset's prompts;
results stored, listed by endpoint, priced per million output tokens; bad requests named; a size bound
from the endpoint's context; cancel; a benchmark whose worker went silent ends failed."""

import time
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

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


def wait_benchmark(server, api, benchmark_id: str, timeout: float = 180) -> dict:
    def done():
        b = api.get(f"/api/v1/benchmarks/{benchmark_id}").json()
        return b if b["status"] in ("succeeded", "failed", "cancelled") else None

    return server.wait_for(done, timeout=timeout, interval=0.3, what=f"benchmark {benchmark_id}")


def assert_refused(api, body: dict, field: str, text: str, code: int = 422) -> None:
    """The benchmark is refused with ``code``, naming ``field`` and saying ``text``."""
    r = api.post("/api/v1/benchmarks", json=body)
    assert r.status_code == code, r.text
    assert r.json()["detail"][0]["loc"] == ["body", field] and text in r.json()["detail"][0]["msg"], r.text


def test_a_concurrency_sweep_measures_latency_and_throughput(server, api, endpoint):
    api.patch("/api/v1/pools/cpu", json={"price_per_chip_hour": 1.5})
    try:
        body = {
            "endpoint_id": endpoint["id"],
            "concurrency": [4, 1],
            "percentile_metrics": ["ttft", "tpot", "itl", "e2el"],
            "metric_percentiles": [99, 50],
            "goodput": {"ttft": 600_000, "tpot": 600_000},  # every request is within: the goodput is the throughput
            **LOAD,
        }
        r = api.post("/api/v1/benchmarks", json=body)
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
        assert level["request_goodput"] == pytest.approx(level["request_throughput"])
        for stat in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            s = level[stat]
            assert 0 < s["median"] == s["percentiles"]["p50"] <= s["percentiles"]["p99"] and s["mean"] > 0, (stat, s)
        assert level["ttft_ms"]["mean"] < level["e2el_ms"]["mean"] <= duration * 1000
        # the cpu pool at 1.5 USD per chip-hour, one chip, at this output throughput
        assert level["usd_per_million_output_tokens"] == pytest.approx(1.5 / (level["output_throughput"] * 3600) * 1e6)

    listed = api.get("/api/v1/benchmarks", params={"endpoint_id": endpoint["id"]}).json()
    assert bench["id"] in [b["id"] for b in listed["data"]]
    r = api.post(f"/api/v1/benchmarks/{bench['id']}/cancel")  # it has ended: nothing to cancel
    assert r.status_code == 409 and r.json()["detail"] == f"benchmark {bench['id']} is already succeeded", r.text


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
        assert_refused(api, {"endpoint_id": endpoint["id"], **body}, field, text, code)

    refused({"concurrency": [0, 4]}, "concurrency", "each from 1 to 4096")
    refused({"mode": "rate", "request_rates": [-1]}, "request_rates", "above 0")
    refused({"num_prompts": 0}, "num_prompts", "greater than or equal to 1")
    refused({"metric_percentiles": [99, 100]}, "metric_percentiles", "above 0 and below 100")
    refused({"percentile_metrics": []}, "percentile_metrics", "at least one of ttft")
    refused({"goodput": {"ttft": -1}}, "goodput", "from 0 to 3600000 ms")
    r = api.post("/api/v1/benchmarks", json={"endpoint_id": endpoint["id"], "goodput": {"itl": 5}})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][:3] == ["body", "goodput", "itl"], r.text
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


def test_a_benchmark_must_fit_its_endpoints_context_and_a_bounded_work(server, api, endpoint, trained_run):
    """The endpoint was started with max_model_len 256: a prompt and its reply must fit in it, and a
    benchmark asks at most 2**23 tokens in all (levels x num_prompts x (input_len + output_len))."""
    before = api.get("/api/v1/benchmarks").json()["count"]
    ep = {"endpoint_id": endpoint["id"]}
    where = f"endpoint {endpoint['id']}'s max_model_len 256"
    assert_refused(
        api,
        {**ep, "input_len": 256, "output_len": 1},
        "input_len",
        f"input_len 256 leaves no room for a reply in {where}",
    )
    assert_refused(
        api,
        {**ep, "input_len": 200, "output_len": 100},
        "output_len",
        f"input_len + output_len = 300 tokens do not fit {where}: at most 56 output tokens with input_len 200",
    )
    # within the context, but 12 levels x 2731 requests x 256 tokens: 8389632 tokens, just over the bound
    levels = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    big = {**ep, "concurrency": levels, "num_prompts": 2731, "input_len": 128, "output_len": 128}
    assert_refused(
        api,
        big,
        "num_prompts",
        "12 levels x 2731 num_prompts x 256 tokens (input_len + output_len) = 8389632 tokens; a benchmark asks at "
        "most 8388608",
    )
    # a dataset's prompts: its reply must leave room for one, and the replies count
    data = {**ep, "dataset_id": trained_run["dataset_id"]}
    assert_refused(
        api, {**data, "output_len": 256}, "output_len", f"output_len 256 leaves no room for a prompt in {where}"
    )
    assert_refused(
        api, {**data, "concurrency": levels, "num_prompts": 10_000, "output_len": 100}, "num_prompts", "12000000"
    )
    assert api.get("/api/v1/benchmarks").json()["count"] == before  # nothing was made
    # one request less fits (and is cancelled at once, before it loads the endpoint for long)
    r = api.post("/api/v1/benchmarks", json={**big, "num_prompts": 2730})
    assert r.status_code == 201, r.text
    assert api.post(f"/api/v1/benchmarks/{r.json()['id']}/cancel").status_code == 200
    assert wait_benchmark(server, api, r.json()["id"])["status"] == "cancelled"


def test_a_running_benchmark_is_cancelled_soon_and_its_endpoint_keeps_serving(server, api, endpoint):
    body = {"endpoint_id": endpoint["id"], "concurrency": [4], "num_prompts": 2000, "input_len": 16, "output_len": 200}
    r = api.post("/api/v1/benchmarks", json=body)
    assert r.status_code == 201, r.text
    bench = r.json()

    def samples_after(at: datetime) -> list[dict]:
        samples = api.get(f"/api/v1/endpoints/{endpoint['id']}/samples", params={"minutes": 5}).json()
        return [s for s in samples if s["source"] == "probe" and datetime.fromisoformat(s["at"]) > at]

    # under load: the model server decodes the benchmark's requests (probed and scraped every second)
    created = datetime.fromisoformat(bench["created_at"])
    server.wait_for(lambda: [s for s in samples_after(created) if s["running"]], timeout=60, what="the load")
    assert api.get(f"/api/v1/benchmarks/{bench['id']}").json()["status"] == "running"

    asked = time.monotonic()
    r = api.post(f"/api/v1/benchmarks/{bench['id']}/cancel")
    assert r.status_code == 200, r.text
    assert r.json()["status"] in ("running", "cancelled") and r.json()["cancel_requested"] is True
    bench = server.wait_for(
        lambda: (b := api.get(f"/api/v1/benchmarks/{bench['id']}").json())["status"] != "running" and b,
        timeout=10,
        what="the cancel",
    )
    assert bench["status"] == "cancelled" and bench["error"] is None, bench
    assert time.monotonic() - asked < 5  # its worker saw it within a beat or two
    assert bench["results"] == [] and bench["requests_done"] < bench["requests_total"]  # the level in flight dropped

    # The worker sent no more: a second after it ended, the model server has nothing running or waiting,
    # and it still answers (the probe, and a request through the gateway).
    ended = datetime.fromisoformat(bench["finished_at"]) + timedelta(seconds=1)
    (sample, *_) = server.wait_for(lambda: samples_after(ended), timeout=30, what="a probe after the cancel")
    assert sample["running"] == 0 and sample["waiting"] == 0 and sample["status_code"] == 200, sample
    assert api.get(f"/api/v1/endpoints/{endpoint['id']}").json()["status"] == "ready"
    body = {"model": endpoint["model"], "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}  # 3, not fewer
    r = api.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    done = bench["requests_done"]
    time.sleep(1.5)
    assert api.get(f"/api/v1/benchmarks/{bench['id']}").json()["requests_done"] == done

    r = api.post(f"/api/v1/benchmarks/{bench['id']}/cancel")
    assert r.status_code == 409 and r.json()["detail"] == f"benchmark {bench['id']} is already cancelled", r.text


def test_a_benchmark_whose_worker_went_silent_fails_on_the_next_beat(server, api, endpoint):
    """A worker lost mid-benchmark (killed, its host gone) leaves the row running with an old heartbeat:
    written here into the server's database, as that worker left it. The pool's live worker fails it on
    its next beat (every second here; silent means 30 s, the default)."""
    from sqlmodel import Session

    from app.benchmarks.models import BenchmarkStatus
    from app.models import Benchmark  # every table: the row refers to others

    owner = api.get("/api/v1/users/me").json()["id"]
    url = server.env.get("TUNEDECK_DATABASE_URL") or f"sqlite:///{server.data_dir / 'tunedeck.db'}"
    engine = sa.create_engine(url)
    now = datetime.now(UTC)
    lost = Benchmark(
        id=f"bm-lost{int(time.time() * 1000)}",
        owner_id=owner,
        endpoint_id=endpoint["id"],
        model=endpoint["model"],
        pool="cpu",
        runtime="local",
        chips=1,
        price_per_chip_hour=0.0,
        status=BenchmarkStatus.running,
        config={"concurrency": [1], "request_rates": [], "num_prompts": 8, "input_len": 24, "output_len": 8},
        requests_total=8,
        requests_done=3,
        attempts=1,
        worker="celery@lost-host",
        heartbeat_at=now - timedelta(seconds=31),
        started_at=now - timedelta(seconds=40),
        updated_at=now - timedelta(seconds=31),
    )
    fresh = Benchmark(**{**lost.model_dump(), "id": lost.id + "f", "heartbeat_at": now})  # its worker beat just now
    try:
        with Session(engine, expire_on_commit=False) as session:
            session.add_all([lost, fresh])
            session.commit()
        failed = wait_benchmark(server, api, lost.id, timeout=15)  # beats come every second
        assert failed["status"] == "failed", failed
        assert failed["error"].startswith("no heartbeat from celery@lost-host for 30s"), failed["error"]
        assert failed["finished_at"] is not None and failed["requests_done"] == 3
        assert api.get(f"/api/v1/benchmarks/{fresh.id}").json()["status"] == "running"  # not silent long enough
        # a queued one that no worker took yet is cancelled at once
        with Session(engine, expire_on_commit=False) as session:
            session.merge(
                Benchmark(
                    **{**lost.model_dump(), "id": lost.id + "q", "status": BenchmarkStatus.queued, "worker": None}
                )
            )
            session.commit()
        r = api.post(f"/api/v1/benchmarks/{lost.id}q/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    finally:
        with engine.begin() as conn:
            conn.execute(sa.delete(Benchmark).where(Benchmark.id.in_([lost.id, fresh.id, lost.id + "q"])))
        engine.dispose()
