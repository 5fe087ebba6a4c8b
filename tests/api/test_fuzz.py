"""Odd input never makes a server error: Schemathesis over the whole OpenAPI schema, and a focused test
for each server error it found.

The fuzzer runs Schemathesis' command line (its coverage phase: boundary and out-of-schema values for
every parameter and field; then its fuzzing phase) against the session's real server, over both API
trees (/api/v1 and the OpenAI-compatible /v1, which share /openapi.json), with the check that no
answer is a 5xx. Its settings are in fuzz.toml. What it cannot exercise, and why:

- SSE streams (`?watch=true`): a stream lasts until the client leaves, so the fuzzer always asks for
  the snapshot, which the same handler answers.
- Work that takes long: the fuzzer's own run waits on a pool no test worker serves. POST /api/v1/runs
  and /v1/fine_tuning/jobs are sent by a user who has no dataset (the fuzzer reuses ids it reads in
  answers, so with one it could start training): they are fuzzed up to the dataset check. The
  estimate, which creates nothing, is fuzzed with the real dataset, through every check of a run.
  Artifacts (a merge), endpoints (a model server) and benchmarks need a trained run, which the fuzzer
  does not make: their routes are fuzzed with ids that do not exist (validation and the 404).
- Uploads (POST /api/v1/datasets, /v1/files) are fuzzed with the multipart bodies the schema allows;
  a file name longer than its column is tested in test_datasets.py.
- The gateway (/v1/chat/completions, /v1/completions) relays a body it does not parse beyond `model`
  (no endpoint is deployed here: it answers 404 or 400).
- Shared state (the other modules' tests run on the same server): admin-only operations run as the
  admin, but what they change or delete is the fuzzer's own (its pool, a user of its own that it may
  disable, a base model that does not exist), and the pools and base models they create are deleted
  after; tokens are revoked with another user's token, so the fuzz user's stays valid.

To explore further than CI does, run it with TUNEDECK_FUZZ_EXAMPLES=100 and another TUNEDECK_FUZZ_SEED.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.test_runs_lifecycle import demo_dataset
from tests.conftest import make_user

CONFIG = Path(__file__).with_name("fuzz.toml")
EXAMPLES = int(os.environ.get("TUNEDECK_FUZZ_EXAMPLES", "10"))
SEED = os.environ.get("TUNEDECK_FUZZ_SEED", "20261123")


@pytest.fixture(scope="module")
def fuzz_user(server):
    """A user of the fuzzer's own, with a ready dataset and a run that waits on a pool no worker serves."""
    _, _, token = make_user(server)
    client = server.client(token)
    dataset = demo_dataset(server, client)
    r = client.post("/api/v1/runs", json={"dataset_id": dataset, "pool": "tpu-v5p-8", "config": {"max_steps": 1}})
    assert r.status_code == 201 and r.json()["status"] == "queued", r.text
    return {"token": token, "client": client, "dataset": dataset, "run": r.json()["id"]}


def test_no_input_makes_a_server_error(server, api, fuzz_user, tmp_path):
    paths = api.get("/openapi.json").json()["paths"]
    assert {"/api/v1/runs", "/v1/fine_tuning/jobs", "/v1/files", "/v1/chat/completions"} <= set(paths)
    before = {kind: _names(api, kind) for kind in ("pools", "base-models")}
    pool = {"name": "fuzz-pool", "accelerator": "cpu", "chips": 1, "price_per_chip_hour": 0.5}
    assert api.post("/api/v1/pools", json=pool).status_code == 201
    env = {
        **os.environ,
        "FUZZ_TOKEN": fuzz_user["token"],
        "FUZZ_OTHER_TOKEN": make_user(server)[2],
        "FUZZ_NO_DATA_TOKEN": make_user(server)[2],
        "FUZZ_VICTIM_ID": str(server.client(make_user(server)[2]).get("/api/v1/users/me").json()["id"]),
        "FUZZ_ADMIN_TOKEN": server.admin_token,
        "FUZZ_DATASET": fuzz_user["dataset"],
        "FUZZ_RUN": fuzz_user["run"],
        "FUZZ_POOL": pool["name"],
    }
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run"),
        f"{server.base_url}/openapi.json",
        *("--checks", "not_a_server_error", "--phases", "coverage,fuzzing"),
        *("--max-examples", str(EXAMPLES), "--seed", SEED, "--workers", "1", "--request-timeout", "30"),
    ]
    try:  # in a directory of its own: Schemathesis keeps its caches in the working directory
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    finally:  # what the admin operations made goes
        for kind, names in before.items():
            for name in _names(api, kind) - names:
                api.delete(f"/api/v1/{kind}/{name}")
    report = done.stdout + done.stderr
    failures = min((i for i in (report.find(" ERRORS "), report.find(" FAILURES ")) if i >= 0), default=0)
    assert done.returncode == 0, report[failures:][:12000]
    selected, tested = re.search(r"Selected: (\d+)/(\d+)", report), re.search(r"Tested: (\d+)", report)
    assert selected and tested and selected[1] == selected[2] == tested[1] == str(len(_operations(paths))), report


def _names(api, kind: str) -> set[str]:
    return {p["name"] for p in api.get(f"/api/v1/{kind}").json()["data"]}


def _operations(paths: dict) -> list[str]:
    return [f"{method} {path}" for path, item in paths.items() for method in item]


# What the fuzzer found, each as a focused test: every one was a 500 (on SQLite, PostgreSQL or both).


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
    r = api.patch(f"/api/v1/users/{2**64}", json={"disabled": True})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["path", "user_id"], r.text
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


def test_json_nested_deeper_than_the_parser_goes_is_a_400(fuzz_user):
    """The NUL check parses JSON bodies before FastAPI does: the parser's RecursionError must still end
    in FastAPI's answer (400), not a server error."""
    r = fuzz_user["client"].post(
        "/api/v1/tokens", content="[" * 100_000 + "]" * 100_000, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert fuzz_user["client"].get("/api/v1/users/me").status_code == 200


def test_a_model_id_with_a_nul_character_is_refused_by_the_gateway(fuzz_user):
    """The gateway reads `model` itself (its body is relayed as it is): PostgreSQL could not look it up."""
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = fuzz_user["client"].post(path, json={"model": "ft:x\x00", "messages": [], "prompt": "hi"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("model:"), r.text
