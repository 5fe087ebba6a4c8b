"""Run requests are validated once, with errors that name the field; nothing is queued."""

import json

import openai
import pytest
from openai import OpenAI

from tests.conftest import make_user, upload, wait_dataset

CHAT = "".join(
    json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}) + "\n"
    for i in range(16)
).encode()


@pytest.fixture(scope="module")
def ready_dataset(server, api) -> str:
    return wait_dataset(server, api, upload(api, "runs.jsonl", CHAT).json()["id"])["id"]


@pytest.fixture(scope="module")
def invalid_dataset(server, api) -> str:
    d = wait_dataset(server, api, upload(api, "bad.jsonl", CHAT + b"{oops\n").json()["id"])
    assert d["status"] == "invalid"
    return d["id"]


@pytest.mark.parametrize(
    "body, loc",
    [
        ({"config": {"lora_rank": 0}}, ["body", "config", "lora_rank"]),
        ({"config": {"max_seq_len": 0}}, ["body", "config", "max_seq_len"]),
        ({"config": {"mesh_tp": 4}}, ["body", "config", "mesh_tp"]),  # the tiny model has 2 KV heads
        ({"config": {"batch_size": 8, "grad_accum_steps": 3}}, ["body", "config", "grad_accum_steps"]),
        ({"config": {"batch_size": 3, "mesh_fsdp": 2}}, ["body", "config", "batch_size"]),
        ({"config": {"batch_size": 6, "mesh_dp": 4}}, ["body", "config", "batch_size"]),  # 6 rows over 4 replicas
        ({"pool": "tpu-v5p-8", "config": {"mesh_dp": 3}}, ["body", "config", "mesh_dp"]),  # 3 replicas of 4 chips
        ({"config": {"target_modules": ["q_proj", "qkv"]}}, ["body", "config", "target_modules"]),
        ({"dataset_id": "ds-doesnotexist"}, ["body", "dataset_id"]),
        ({"base_model": "llama-9"}, ["body", "base_model"]),
        ({"pool": "nowhere"}, ["body", "pool"]),
        ({"config": {"quantization": "nf4"}}, ["body", "config", "quantization"]),
    ],
)
def test_bad_config_names_the_field_and_queues_nothing(api, ready_dataset, body, loc):
    before = api.get("/api/v1/runs").json()["count"]
    payload = {"base_model": "tiny-gemma4", "dataset_id": ready_dataset, **body}
    r = api.post("/api/v1/runs", json=payload)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == loc, r.json()
    assert api.get("/api/v1/runs").json()["count"] == before


@pytest.mark.parametrize("field", ["dataset_id", "validation_dataset_id"])
def test_an_empty_dataset_id_is_unknown(api, ready_dataset, field):
    before = api.get("/api/v1/runs").json()["count"]
    body = {"dataset_id": ready_dataset, "pool": "tpu-v5p-8", field: ""}
    r = api.post("/api/v1/runs", json=body)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", field], r.text
    assert "unknown dataset ''" in r.json()["detail"][0]["msg"]
    assert api.get("/api/v1/runs").json()["count"] == before


def test_invalid_dataset_is_refused(api, invalid_dataset):
    r = api.post("/api/v1/runs", json={"dataset_id": invalid_dataset})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "dataset_id"] and "invalid" in r.json()["detail"][0]["msg"]


def test_another_users_dataset_is_unknown(server, api, ready_dataset):
    _, _, token = make_user(server)
    r = server.client(token).post("/api/v1/runs", json={"dataset_id": ready_dataset})
    assert r.status_code == 422 and "unknown dataset" in r.json()["detail"][0]["msg"]


def test_openai_create_names_the_field(server, ready_dataset):
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key=server.admin_token)
    with pytest.raises(openai.UnprocessableEntityError, match="training_file"):
        client.fine_tuning.jobs.create(model="tiny-gemma4", training_file="ds-nope")
    with pytest.raises(openai.UnprocessableEntityError, match="lora_rank"):
        client.fine_tuning.jobs.create(
            model="tiny-gemma4", training_file=ready_dataset, extra_body={"tunedeck": {"config": {"lora_rank": 0}}}
        )
    with pytest.raises(openai.UnprocessableEntityError, match="model"):
        client.fine_tuning.jobs.create(model="gpt-4o", training_file=ready_dataset)


def test_a_dataset_used_by_a_run_cannot_be_deleted(server, api):
    dataset = wait_dataset(server, api, upload(api, "used.jsonl", CHAT).json()["id"])["id"]
    run = api.post("/api/v1/runs", json={"dataset_id": dataset, "config": {"max_steps": 1}}).json()
    api.post(f"/api/v1/runs/{run['id']}/cancel")
    r = api.delete(f"/api/v1/datasets/{dataset}")
    assert r.status_code == 409 and "used by a run" in r.json()["detail"]
    assert api.get(f"/api/v1/datasets/{dataset}").status_code == 200
    assert (server.data_dir / "storage" / "datasets" / dataset / "data").exists()
    r = OpenAI(base_url=f"{server.base_url}/v1", api_key=server.admin_token)
    with pytest.raises(openai.ConflictError):
        r.files.delete(dataset)


# The tiny model at lengths whose attention scores alone (7 f32 copies of batch x 8 heads x T x T,
# as XLA holds them; see app/runs/estimate.py) are far beyond a 16 GiB chip.
@pytest.mark.parametrize(
    "config, loc",
    [
        ({"max_seq_len": 65536, "batch_size": 8}, ["body", "config", "max_seq_len"]),  # no row of 65k fits
        ({"max_seq_len": 4096, "batch_size": 64}, ["body", "config", "batch_size"]),  # one row of 4k fits
    ],
)
def test_a_run_that_will_not_fit_is_refused_with_the_field_to_lower(api, ready_dataset, config, loc):
    before = api.get("/api/v1/runs").json()["count"]
    body = {"base_model": "tiny-gemma4", "dataset_id": ready_dataset, "config": config}
    estimate = api.post("/api/v1/runs/estimate", json=body).json()
    assert estimate["fits"] is False and estimate["lower"] == ".".join(loc[1:]), estimate
    r = api.post("/api/v1/runs", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"][0]
    assert detail["loc"] == loc and "will not fit" in detail["msg"], detail
    assert api.get("/api/v1/runs").json()["count"] == before


def test_a_forced_run_that_will_not_fit_is_queued_with_a_warning(server, api, ready_dataset):
    # On the TPU pool, which no test worker serves: the run is queued, never trained here.
    config = {"max_seq_len": 262144, "batch_size": 4}
    body = {"base_model": "tiny-gemma4", "dataset_id": ready_dataset, "pool": "tpu-v5p-8", "config": config}
    assert api.post("/api/v1/runs", json=body).status_code == 422
    r = api.post("/api/v1/runs", json={**body, "force": True})
    assert r.status_code == 201, r.text
    run = r.json()
    assert run["status"] == "queued" and "force" not in run["config"]
    events = api.get(f"/api/v1/runs/{run['id']}/events").json()["data"]
    warnings = [e for e in events if e["level"] == "warn"]
    assert len(warnings) == 1 and "force" in warnings[0]["message"] and "GiB" in warnings[0]["message"], events
    # The OpenAI route takes it in its tunedeck extras.
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key=server.admin_token)
    extras = {"pool": "tpu-v5p-8", "config": config}
    with pytest.raises(openai.UnprocessableEntityError, match="max_seq_len"):
        client.fine_tuning.jobs.create(
            model="tiny-gemma4", training_file=ready_dataset, extra_body={"tunedeck": extras}
        )
    job = client.fine_tuning.jobs.create(
        model="tiny-gemma4", training_file=ready_dataset, extra_body={"tunedeck": {**extras, "force": True}}
    )
    for run_id in (run["id"], job.id):
        assert api.post(f"/api/v1/runs/{run_id}/cancel").status_code == 200


def test_an_active_run_is_deleted_only_once_cancelled(server, api, ready_dataset):
    # On the TPU pool, which no test worker serves: it stays queued.
    r = api.post("/api/v1/runs", json={"dataset_id": ready_dataset, "pool": "tpu-v5p-8"})
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    r = api.delete(f"/api/v1/runs/{run_id}")
    assert r.status_code == 409 and r.json()["detail"] == f"run {run_id} is queued: cancel it first", r.text
    assert api.get(f"/api/v1/runs/{run_id}").json()["status"] == "queued"
    _, _, token = make_user(server)
    assert server.client(token).delete(f"/api/v1/runs/{run_id}").status_code == 404  # not theirs
    assert api.post(f"/api/v1/runs/{run_id}/cancel").status_code == 200
    assert api.delete(f"/api/v1/runs/{run_id}").status_code == 204
    assert api.get(f"/api/v1/runs/{run_id}").status_code == 404
    assert api.get(f"/api/v1/runs/{run_id}/events").status_code == 404
    assert api.delete(f"/api/v1/runs/{run_id}").status_code == 404


def test_a_users_active_runs_are_limited_on_both_api_trees(server, api):
    """An admin sets a user's limit on active runs; the run past it is refused with 429 naming the limit,
    whichever API it comes through, and nothing is queued; a run that ends frees its place."""
    _, _, token = make_user(server)
    user = server.client(token)
    me = user.get("/api/v1/users/me").json()
    assert me["max_active_runs"] is None  # the setting's default
    assert user.patch(f"/api/v1/users/{me['id']}", json={"max_active_runs": 5}).status_code == 403  # admins only
    r = api.patch(f"/api/v1/users/{me['id']}", json={"max_active_runs": -1})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "max_active_runs"]
    r = api.patch(f"/api/v1/users/{me['id']}", json={"max_active_runs": 2})
    assert r.status_code == 200 and r.json()["max_active_runs"] == 2 and r.json()["max_live_endpoints"] is None
    dataset = wait_dataset(server, user, upload(user, "mine.jsonl", CHAT).json()["id"])["id"]

    # On the TPU pool, which no test worker serves: they stay queued, active.
    body = {"dataset_id": dataset, "pool": "tpu-v5p-8"}
    first, second = (user.post("/api/v1/runs", json=body) for _ in range(2))
    assert first.status_code == second.status_code == 201, (first.text, second.text)
    limit = "you have 2 active runs; your limit is 2"
    r = user.post("/api/v1/runs", json=body)
    assert r.status_code == 429 and r.json()["detail"].startswith(limit), r.text
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key=token, max_retries=0)
    with pytest.raises(openai.RateLimitError) as refused:
        client.fine_tuning.jobs.create(
            model="tiny-gemma4", training_file=dataset, extra_body={"tunedeck": {"pool": "tpu-v5p-8"}}
        )
    assert refused.value.body["message"].startswith(limit), refused.value.body
    assert user.get("/api/v1/runs").json()["count"] == 2

    assert user.post(f"/api/v1/runs/{first.json()['id']}/cancel").status_code == 200  # one place free
    third = user.post("/api/v1/runs", json=body)
    assert third.status_code == 201, third.text
    assert user.post("/api/v1/runs", json=body).status_code == 429
    assert api.patch(f"/api/v1/users/{me['id']}", json={"max_active_runs": None}).json()["max_active_runs"] is None
    fourth = user.post("/api/v1/runs", json=body)  # the default (20) again
    assert fourth.status_code == 201, fourth.text
    for run in (second, third, fourth):
        assert user.post(f"/api/v1/runs/{run.json()['id']}/cancel").status_code == 200


def test_errors_quote_a_huge_value_by_a_short_prefix(server, api, ready_dataset):
    """A bad field value is quoted in the answer by its first 200 characters, whichever check refused it
    (the schema's or the service's), on both API trees; a body of many bad items lists the first errors."""
    before = api.get("/api/v1/runs").json()["count"]
    huge = "p" * 500_000
    r = api.post("/api/v1/runs", json={"dataset_id": ready_dataset, "pool": huge})
    assert r.status_code == 422 and len(r.content) < 1000, r.content[:1000]
    (error,) = r.json()["detail"]  # longer than any pool name: refused by the schema, quoted short
    assert error["loc"] == ["body", "pool"] and error["input"] == "p" * 200 + "…", error
    r = api.post("/api/v1/runs", json={"dataset_id": ready_dataset, "suffix": huge})
    assert r.status_code == 422 and len(r.content) < 1000, r.content[:1000]
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "suffix"] and error["input"] == "p" * 200 + "…", error
    r = api.post("/api/v1/runs", json={"dataset_id": ready_dataset, "config": {"target_modules": [[huge]] * 2}})
    assert r.status_code == 422 and len(r.content) < 2000, r.content[:2000]
    assert r.json()["detail"][0]["input"].startswith('["ppp') and r.json()["detail"][0]["input"].endswith("…")
    r = api.post("/api/v1/benchmarks", json={"endpoint_id": "ep-none", "concurrency": ["x"] * 100_000})
    assert r.status_code == 422 and len(r.content) < 10_000, len(r.content)
    detail = r.json()["detail"]
    assert len(detail) == 21 and detail[0]["loc"] == ["body", "concurrency", 0], detail[0]
    assert detail[-1]["msg"] == "and 99980 more errors", detail[-1]
    job = {"model": "tiny-gemma4", "training_file": huge, "tunedeck": {"pool": "tpu-v5p-8"}}
    r = api.post("/v1/fine_tuning/jobs", json=job)
    assert r.status_code == 422 and len(r.content) < 1000, r.content[:1000]
    assert r.json()["error"]["message"].startswith("training_file:"), r.json()
    assert api.get(f"/api/v1/runs/{huge[:50_000]}").json()["detail"] == f"run {'p' * 200}… not found"
    assert api.get("/api/v1/runs").json()["count"] == before


def _post_raw(client, path: str, body: str):
    """A JSON body as written (JSON's NaN and Infinity tokens, numbers beyond 64 bits)."""
    return client.post(path, content=body, headers={"content-type": "application/json"})


# On the TPU pool, which no test worker serves: a run the old code let through is queued, never trained.
@pytest.mark.parametrize(
    "config, field",
    [
        ('{"lora_alpha": Infinity}', "lora_alpha"),
        ('{"lora_alpha": NaN}', "lora_alpha"),
        ('{"lora_alpha": "Infinity"}', "lora_alpha"),  # a string pydantic would read as a float
        ('{"seed": 18446744073709551616}', "seed"),
        ('{"warmup_steps": 10000000000000}', "warmup_steps"),
    ],
)
def test_odd_numbers_name_the_field_and_create_nothing(api, ready_dataset, config, field):
    before = api.get("/api/v1/runs").json()["count"]
    body = f'{{"dataset_id": "{ready_dataset}", "pool": "tpu-v5p-8", "config": {config}}}'
    r = _post_raw(api, "/api/v1/runs", body)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "config", field], r.json()
    runs = api.get("/api/v1/runs")
    assert runs.status_code == 200 and runs.json()["count"] == before


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            '"method": {"type": "supervised", "supervised": {"hyperparameters": [1]}}',
            "method.supervised.hyperparameters",
        ),
        ('"hyperparameters": {"learning_rate_multiplier": Infinity}', "hyperparameters.learning_rate_multiplier"),
        ('"hyperparameters": {"n_epochs": 1000000000000}', "hyperparameters.n_epochs"),
        ('"seed": 18446744073709551616', "seed"),
        ('"tunedeck": {"pool": "tpu-v5p-8", "config": {"lora_alpha": Infinity}}', "tunedeck.config.lora_alpha"),
    ],
)
def test_openai_odd_json_names_the_param_and_creates_nothing(api, ready_dataset, extra, param):
    before = len(api.get("/v1/fine_tuning/jobs", params={"limit": 1000}).json()["data"])
    pool = "" if '"tunedeck"' in extra else '"tunedeck": {"pool": "tpu-v5p-8"}, '
    body = f'{{"model": "tiny-gemma4", "training_file": "{ready_dataset}", {pool}{extra}}}'
    r = _post_raw(api, "/v1/fine_tuning/jobs", body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"].startswith(f"{param}:"), r.json()
    jobs = api.get("/v1/fine_tuning/jobs", params={"limit": 1000})
    assert jobs.status_code == 200 and len(jobs.json()["data"]) == before


def test_a_model_id_longer_than_its_column_is_refused(server, api, ready_dataset, tmp_path):
    """A run's model id (ft:BASE:SUFFIX:ID) is stored when it succeeds: a long base-model name with a
    long suffix must be refused when the run is made, not fail the run's ending on PostgreSQL."""
    from worker.training.tiny import create_tiny_gemma4

    name = "a-base-model-whose-name-takes-all-of-the-sixty-four-characters-x"
    source = create_tiny_gemma4(tmp_path / "tiny")
    r = api.post("/api/v1/base-models", json={"name": name, "preset": "tiny-gemma4", "source": str(source)})
    assert r.status_code == 201, r.text
    before = api.get("/api/v1/runs").json()["count"]
    body = {"base_model": name, "dataset_id": ready_dataset, "pool": "tpu-v5p-8", "suffix": "s" * 64}
    r = api.post("/api/v1/runs", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"][0]
    assert detail["loc"] == ["body", "suffix"] and "128" in detail["msg"], detail
    job = {"model": name, "training_file": ready_dataset, "suffix": "s" * 64, "tunedeck": {"pool": "tpu-v5p-8"}}
    r = api.post("/v1/fine_tuning/jobs", json=job)
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("suffix:"), r.text
    runs = api.get("/api/v1/runs")
    assert runs.status_code == 200 and runs.json()["count"] == before
    # The longest suffix that fits is taken.
    run = api.post("/api/v1/runs", json={**body, "suffix": "s" * (128 - len(f"ft:{name}::run-") - 20)})
    assert run.status_code == 201, run.text
    assert api.post(f"/api/v1/runs/{run.json()['id']}/cancel").status_code == 200
