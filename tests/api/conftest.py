"""Fixtures shared by the API tests."""

import pytest

from tests.api.test_runs_lifecycle import demo_dataset, wait_run

# A run small enough to train in seconds, with checkpoints at steps 3 and 6.
TINY_RUN = {"max_steps": 6, "batch_size": 8, "max_seq_len": 64, "checkpoint_every_steps": 3, "learning_rate": 0.01}


@pytest.fixture(scope="session")
def trained_run(server, api) -> dict:
    """A tiny run that succeeded (its merged artifact is built after it): shared by the artifact and
    endpoint tests, so the suite trains it once."""
    dataset = demo_dataset(server, api)
    r = api.post("/api/v1/runs", json={"dataset_id": dataset, "config": TINY_RUN})
    assert r.status_code == 201, r.text
    run = wait_run(server, api, r.json()["id"])
    assert run["status"] == "succeeded", (run["error"], server.log()[-3000:])
    return run


@pytest.fixture(scope="session")
def artifact(server, api, trained_run) -> dict:
    """The merged artifact of the shared tiny run."""
    from tests.api.test_artifacts import wait_artifact

    listed = api.get("/api/v1/artifacts", params={"run_id": trained_run["id"]}).json()["data"]
    # the one made when it succeeded (an evaluation may have merged an earlier checkpoint since)
    (art,) = [a for a in listed if a["kind"] == "merged" and a["checkpoint_step"] == TINY_RUN["max_steps"]]
    art = wait_artifact(server, api, art["id"])
    assert art["status"] == "succeeded", art["error"]
    return art
