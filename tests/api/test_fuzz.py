"""Odd input never makes a server error: a focused test for each server error that Schemathesis found
over the OpenAPI schema (each was a 500 on SQLite, PostgreSQL or both)."""

import pytest

from tests.api.test_runs_lifecycle import demo_dataset
from tests.conftest import make_user


@pytest.fixture(scope="module")
def fuzz_user(server):
    """A user of the fuzzer's own, with a ready dataset and a run that waits on a pool no worker serves."""
    _, _, token = make_user(server)
    client = server.client(token)
    dataset = demo_dataset(server, client)
    r = client.post("/api/v1/runs", json={"dataset_id": dataset, "pool": "tpu-v5p-8", "config": {"max_steps": 1}})
    assert r.status_code == 201 and r.json()["status"] == "queued", r.text
    return {"token": token, "client": client, "dataset": dataset, "run": r.json()["id"]}


@pytest.mark.parametrize(
    "path", ["/api/v1/runs", "/api/v1/datasets", "/api/v1/artifacts", "/api/v1/endpoints", "/api/v1/benchmarks"]
)
def test_an_offset_beyond_the_database_integers_is_a_422(api, path):
    r = api.get(path, params={"offset": 2**65})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "offset"], r.text
    largest = api.get(path, params={"offset": 2**31 - 1})
    assert largest.status_code == 200 and largest.json()["data"] == []


def test_integers_in_urls_beyond_the_database_integers_are_a_422(api, fuzz_user):
    client = fuzz_user["client"]
    r = client.get(f"/api/v1/runs/{fuzz_user['run']}/metrics", params={"since_step": 2**64})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "since_step"], r.text
    r = client.get(f"/v1/fine_tuning/jobs/{fuzz_user['run']}/events", params={"after": 2**64})
    assert r.status_code == 422 and r.json()["error"]["param"] == "after", r.text
    r = client.delete(f"/api/v1/tokens/{2**64}")
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["path", "token_id"], r.text
    assert client.get("/api/v1/users/me").status_code == 200


@pytest.mark.parametrize(
    "method, path, kwargs, loc",
    [
        ("GET", "/api/v1/runs/run-%00", {}, ["path", "run_id"]),
        ("GET", "/api/v1/pools/cpu%00", {}, ["path", "name"]),
        ("GET", "/v1/files", {"params": {"after": "ds-\x00"}}, ["query", "after"]),
        ("POST", "/api/v1/tokens", {"json": {"name": "a\x00b"}}, ["body", "name"]),
        (
            "POST",
            "/api/v1/runs/estimate",
            {"json": {"dataset_id": "x", "config": {"\x00": 1}}},
            ["body", "config", "\x00"],
        ),
        ("POST", "/v1/fine_tuning/jobs", {"json": {"model": "tiny\x00", "training_file": "ds-1"}}, ["body", "model"]),
    ],
)
def test_text_with_a_nul_character_is_a_422_naming_it(fuzz_user, method, path, kwargs, loc):
    """PostgreSQL can neither store nor compare text holding NUL: it was a 500 wherever it reached a query."""
    client = fuzz_user["client"]
    tokens = client.get("/api/v1/tokens").json()["count"]
    r = client.request(method, path, **kwargs)
    assert r.status_code == 422, r.text
    if path.startswith("/v1/"):
        assert r.json()["error"]["param"] == ".".join(loc[1:]), r.json()
    else:
        assert r.json()["detail"][0]["loc"] == loc, r.json()
    assert client.get("/api/v1/tokens").json()["count"] == tokens
