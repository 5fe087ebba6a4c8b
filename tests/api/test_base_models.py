"""Base models: the presets, and HF-layout sources an admin registers (a local directory or a URL)."""

import json
import shutil

import pytest

from tests.api.test_runs_lifecycle import demo_dataset, wait_run
from tests.checkpoints import config_by_new_transformers
from tests.conftest import make_user
from worker.training.tiny import create_tiny_gemma4


@pytest.fixture(scope="module")
def tiny_copy(tmp_path_factory):
    """A tiny Gemma 4 checkpoint outside the server's data dir, as a user's own fine-tune would be:
    saved by a newer transformers, so its config.json states the global layers' shape in the
    ``per_layer_config`` form (the built-in tiny model has the release form)."""
    path = create_tiny_gemma4(tmp_path_factory.mktemp("elsewhere") / "my-tiny")
    config = json.loads((path / "config.json").read_text())
    text = {k: v for k, v in config["text_config"].items() if k not in ("model_type", "dtype", "architectures")}
    config["text_config"] = {**config_by_new_transformers(**text), "model_type": "gemma4_text"}
    assert "global_head_dim" not in config["text_config"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def names(api) -> list[str]:
    return [m["name"] for m in api.get("/api/v1/base-models").json()["data"]]


def test_presets_are_listed_with_their_size(api):
    models = {m["name"]: m for m in api.get("/api/v1/base-models").json()["data"]}
    assert {"tiny-gemma4", "gemma-4-e2b", "gemma-4-e4b", "gemma-4-31b"} <= set(models)
    assert all(models[n]["builtin"] for n in ("tiny-gemma4", "gemma-4-31b"))
    assert 30.0e9 < models["gemma-4-31b"]["params"] < 31.5e9
    assert api.get("/api/v1/base-models/gemma-4-31b").json()["preset"] == "gemma-4-31b"
    assert api.get("/api/v1/base-models/nope").status_code == 404


def test_bad_sources_are_refused_naming_the_field(server, api, tiny_copy, tmp_path):
    before = names(api)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_copy / "config.json", no_weights / "config.json")
    shutil.copy(tiny_copy / "tokenizer.json", no_weights / "tokenizer.json")
    other = tmp_path / "other-arch"
    shutil.copytree(tiny_copy, other)
    config = json.loads((other / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 512
    (other / "config.json").write_text(json.dumps(config))
    wider = tmp_path / "wider-global-heads"
    shutil.copytree(tiny_copy, wider)
    config = json.loads((wider / "config.json").read_text())
    config["text_config"]["per_layer_config"]["1"]["head_dim"] = 64
    (wider / "config.json").write_text(json.dumps(config))
    cases = [
        ({"source": "relative/dir"}, "source", "absolute"),
        ({"source": str(tmp_path / "missing")}, "source", "does not exist"),
        ({"source": str(no_weights)}, "source", "no *.safetensors"),
        ({"source": "nosuchproto://bucket/x"}, "source", "cannot open"),
        ({"preset": "gemma-4-31b"}, "preset", "does not match preset gemma-4-31b"),
        ({"source": str(other)}, "preset", "intermediate_size is 512, the preset has 256"),
        ({"source": str(wider)}, "preset", "the full_attention layers' head_dim) is 64, the preset has 32"),
        ({"preset": "llama"}, "preset", "unknown preset"),
        ({"name": "Bad Name"}, "name", "pattern"),
    ]
    for override, field, text in cases:
        body = {"name": "mine", "preset": "tiny-gemma4", "source": str(tiny_copy), **override}
        r = api.post("/api/v1/base-models", json=body)
        assert r.status_code == 422, (override, r.text)
        detail = r.json()["detail"][0]
        assert detail["loc"][-1] == field and text in detail["msg"], (override, detail)
    assert names(api) == before  # nothing registered

    _, _, token = make_user(server)
    r = server.client(token).post(
        "/api/v1/base-models", json={"name": "mine", "preset": "tiny-gemma4", "source": str(tiny_copy)}
    )
    assert r.status_code == 403
    assert (
        api.post(
            "/api/v1/base-models", json={"name": "tiny-gemma4", "preset": "tiny-gemma4", "source": "/x"}
        ).status_code
        == 409
    )


def test_a_run_trains_from_a_registered_url_copied_once_to_the_host(server, api, tiny_copy):
    r = api.post(
        "/api/v1/base-models",
        json={"name": "my-tiny", "preset": "tiny-gemma4", "source": f"file://{tiny_copy}", "description": "mine"},
    )
    assert r.status_code == 201, r.text
    assert r.json()["builtin"] is False and r.json()["source"] == f"file://{tiny_copy}"
    dataset = demo_dataset(server, api)
    config = {"max_steps": 4, "batch_size": 8, "max_seq_len": 64, "checkpoint_every_steps": 4}
    run = api.post("/api/v1/runs", json={"base_model": "my-tiny", "dataset_id": dataset, "config": config}).json()
    run = wait_run(server, api, run["id"])
    assert run["status"] == "succeeded", (run["error"], server.log()[-3000:])
    assert run["fine_tuned_model"].startswith("ft:my-tiny:")
    events = [e["message"] for e in api.get(f"/api/v1/runs/{run['id']}/events").json()["data"]]
    assert any(m.startswith(f"copying base model my-tiny from file://{tiny_copy}") for m in events), events
    (copy,) = [p for p in (server.data_dir / "models" / "cache").iterdir() if p.is_dir()]  # and its lock file
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in tiny_copy.iterdir())
    # A model that runs use stays; an unused one goes.
    assert api.delete("/api/v1/base-models/my-tiny").status_code == 409
    assert api.delete("/api/v1/base-models/gemma-4-31b").status_code == 409
    r = api.post("/api/v1/base-models", json={"name": "spare", "preset": "tiny-gemma4", "source": str(tiny_copy)})
    assert r.status_code == 201, r.text
    assert api.delete("/api/v1/base-models/spare").status_code == 204
    assert "spare" not in names(api)


def test_a_base_model_without_a_chat_template_is_refused_for_chat_data(server, api, tiny_copy, tmp_path):
    bare = tmp_path / "no-template"
    shutil.copytree(tiny_copy, bare)
    (bare / "chat_template.jinja").unlink()
    r = api.post("/api/v1/base-models", json={"name": "no-template", "preset": "tiny-gemma4", "source": str(bare)})
    assert r.status_code == 201, r.text
    runs_before = api.get("/api/v1/runs").json()["count"]
    dataset = demo_dataset(server, api)  # chat records
    r = api.post("/api/v1/runs", json={"base_model": "no-template", "dataset_id": dataset, "config": {"max_steps": 1}})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"][0]
    assert detail["loc"][-1] == "base_model" and "no chat template" in detail["msg"], detail
    assert api.get("/api/v1/runs").json()["count"] == runs_before  # nothing made, nothing queued
    assert api.delete("/api/v1/base-models/no-template").status_code == 204
