"""Runs end to end with real Tunix LoRA training of the tiny Gemma 4 on the cpu pool."""

import contextlib
import os
import signal
import time

import openai
import psutil
import pytest
from openai import OpenAI

from tests.conftest import start_server, stop_server, wait_dataset

SMALL = {
    "max_steps": 30,
    "batch_size": 8,
    "max_seq_len": 64,
    "checkpoint_every_steps": 10,
    "eval_every_steps": 10,
    "learning_rate": 0.005,
    "lr_schedule": "constant",
}


def demo_dataset(server, client) -> str:
    return wait_dataset(server, client, client.post("/api/v1/datasets/demo").json()["id"])["id"]


def wait_run(server, client, run_id: str, done=("succeeded", "failed", "cancelled"), timeout: float = 300) -> dict:
    def check():
        run = client.get(f"/api/v1/runs/{run_id}").json()
        return run if run["status"] in done else None

    return server.wait_for(check, timeout=timeout, interval=0.5, what=f"run {run_id} to reach {done}")


def steps_of(client, run_id: str) -> list[int]:
    return [p["step"] for p in client.get(f"/api/v1/runs/{run_id}/metrics").json()["data"] if "loss" in p]


def test_run_trains_and_succeeds(server, api):
    dataset = demo_dataset(server, api)
    config = {**SMALL, "checkpoints_kept": 2, "eval_every_checkpoint": True}
    r = api.post("/api/v1/runs", json={"base_model": "tiny-gemma4", "dataset_id": dataset, "config": config})
    assert r.status_code == 201, r.text
    run = wait_run(server, api, r.json()["id"])
    assert run["status"] == "succeeded", (run["error"], server.log()[-3000:])
    assert steps_of(api, run["id"]) == list(range(1, 31))
    points = api.get(f"/api/v1/runs/{run['id']}/metrics").json()["data"]
    losses = [p["loss"] for p in points if "loss" in p]
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(p["tokens_per_s_per_chip"] > 0 and p["host_rss_gb"] > 0 for p in points if "loss" in p)
    # Saved at 10, 20, 30; Orbax kept the last 2, and the list shows what is on disk.
    ckpts = api.get(f"/api/v1/runs/{run['id']}/checkpoints").json()["data"]
    assert [c["step"] for c in ckpts] == [20, 30]
    for c in ckpts:  # each carries its own step's loss and the eval loss measured at that step
        at_step = {k: v for p in points if p["step"] == c["step"] for k, v in p.items() if k != "step"}
        assert c["metrics"]["loss"] == at_step["loss"] and c["metrics"]["eval_loss"] == at_step["eval_loss"]
    assert run["fine_tuned_model"].startswith("ft:tiny-gemma4:")
    messages = [e["message"] for e in api.get(f"/api/v1/runs/{run['id']}/events").json()["data"]]
    for phase in ("phase: loading", "phase: training", "removed the checkpoint(s) at step 10", "succeeded"):
        assert any(m.startswith(phase) for m in messages), messages
    # eval_every_checkpoint: once it succeeded, every checkpoint it kept and its base were put to its
    # validation split (the records its validation_fraction held out), as the run page's button would
    # (cancelled here: the evaluation tests follow one through).
    (evaluation,) = server.wait_for(
        lambda: api.get("/api/v1/evaluations", params={"run_id": run["id"]}).json()["data"],
        timeout=10,
        what="the run's checkpoint evaluation",
    )
    assert [(s["kind"], s.get("step"), s.get("sweep")) for s in evaluation["subjects"]] == [
        ("checkpoint", 20, True),
        ("checkpoint", 30, True),
        ("base", None, None),
    ]
    assert evaluation["dataset_id"] == dataset and evaluation["config"]["metrics"] == ["exact_match", "chrf"]
    assert evaluation["config"]["validation_of"] == run["id"]
    # The run's event is written once the evaluation is (a moment after it shows in the list).
    server.wait_for(
        lambda: (
            f"evaluating every checkpoint and the base model: {evaluation['id']}"
            in [e["message"] for e in api.get(f"/api/v1/runs/{run['id']}/events").json()["data"]]
        ),
        timeout=10,
        what="the run's event naming its checkpoint evaluation",
    )
    assert api.post(f"/api/v1/evaluations/{evaluation['id']}/cancel").status_code == 200
    # The test servers keep no training process on standby (TUNEDECK_TRAINING_STANDBY=0): once the run's
    # own has exited, none waits for the next run.
    server.wait_for(lambda: not standbys(server), timeout=30, what="no training process left")


def test_openai_fine_tuning_jobs(server, api):
    dataset = demo_dataset(server, api)
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key=server.admin_token)
    job = client.fine_tuning.jobs.create(
        model="tiny-gemma4",
        training_file=dataset,
        suffix="demo",
        seed=7,
        hyperparameters={"batch_size": 8},
        extra_body={"tunedeck": {"pool": "cpu", "config": {**SMALL, "max_steps": 1000, "checkpoint_every_steps": 5}}},
    )
    assert job.status in ("queued", "running") and job.model == "tiny-gemma4" and job.seed == 7
    assert job.id in [j.id for j in client.fine_tuning.jobs.list()]

    def checkpointed():
        return client.fine_tuning.jobs.checkpoints.list(job.id).data

    ckpts = server.wait_for(checkpointed, timeout=240, interval=0.5, what="a first checkpoint")
    assert ckpts[0].step_number % 5 == 0 and ckpts[0].fine_tuning_job_id == job.id

    # Pause keeps a checkpoint at the step it stopped; resume continues right after it. A pause is no
    # lost attempt: those a run has for lost workers stay untouched.
    client.fine_tuning.jobs.pause(job.id)
    paused = wait_run(server, api, job.id, done=("paused",), timeout=30)
    ckpt_steps = [c["step"] for c in api.get(f"/api/v1/runs/{job.id}/checkpoints").json()["data"]]
    assert paused["step"] == ckpt_steps[-1], (paused["step"], ckpt_steps)
    # queued, or already running where a worker took it before the reply was written (Redis)
    assert client.fine_tuning.jobs.resume(job.id).status in ("queued", "running")
    server.wait_for(
        lambda: api.get(f"/api/v1/runs/{job.id}").json()["step"] > paused["step"] + 2,
        timeout=240,
        interval=0.5,
        what="training to continue after resume",
    )
    assert api.get(f"/api/v1/runs/{job.id}").json()["attempts"] == 2
    assert server.sql("SELECT lost_attempts FROM runs WHERE id = :id", id=job.id) == [(0,)]
    steps = steps_of(api, job.id)
    assert steps == list(range(1, len(steps) + 1)), "resume continues after the paused step"

    start = time.monotonic()
    assert client.fine_tuning.jobs.cancel(job.id).id == job.id
    wait_run(server, api, job.id, done=("cancelled",), timeout=15)
    assert time.monotonic() - start < 10
    assert client.fine_tuning.jobs.retrieve(job.id).status == "cancelled"
    events = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data]
    for expected in ("pause requested", "cancellation requested", "cancelled"):
        assert expected in events, events
    assert any(m.startswith("paused at step") for m in events) and any(
        m.startswith("resumed from step") for m in events
    )

    # Deleted, now that it is over: its checkpoints and logs on disk, its rows; and its dataset is free.
    files = server.data_dir / "runs" / job.id
    assert list((files / "checkpoints").iterdir()) and list(files.glob("attempt-*.log"))
    assert api.delete(f"/api/v1/datasets/{dataset}").status_code == 409  # used by the run
    assert api.delete(f"/api/v1/runs/{job.id}").status_code == 204
    assert api.get(f"/api/v1/runs/{job.id}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve(job.id)
    assert not files.exists()
    for table in ("run_events", "run_metrics", "run_checkpoints"):
        assert server.sql(f"SELECT count(*) FROM {table} WHERE run_id = :id", id=job.id) == [(0,)], table
    assert api.delete(f"/api/v1/datasets/{dataset}").status_code == 204


@pytest.fixture
def fast_reaper_server(tmp_path):
    # With the default standby: each of the worker's pool processes starts a training process ahead.
    srv = start_server(tmp_path / "reaper", {"TUNEDECK_STALE_SECONDS": "4", "TUNEDECK_TRAINING_STANDBY": "1"})
    yield srv
    stop_server(srv)


def worker_tree(server) -> list[psutil.Process]:
    up = psutil.Process(server.proc.pid)
    workers = [p for p in up.children() if "worker" in " ".join(p.cmdline())]
    return [proc for w in workers for proc in (w, *w.children(recursive=True))]


def running_with(server, word: str) -> list[psutil.Process]:
    """The worker's processes with ``word`` in their command line (not those that exited since they were
    listed: a zombie, or gone)."""
    found = []
    for proc in worker_tree(server):
        try:
            if word in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.NoSuchProcess:  # ZombieProcess included
            pass
    return found


def standbys(server) -> set[int]:
    """The worker's training processes (`python -m worker.runs --standby`), waiting or training."""
    return {proc.pid for proc in running_with(server, "--standby")}


def test_sigkill_worker_mid_run_resumes_from_checkpoint(fast_reaper_server):
    srv = fast_reaper_server
    api = srv.client()
    ahead = srv.wait_for(lambda: len(s := standbys(srv)) == 2 and s, timeout=30, what="a standby per pool process")
    dataset = demo_dataset(srv, api)
    config = {**SMALL, "max_steps": 60}
    run_id = api.post("/api/v1/runs", json={"dataset_id": dataset, "config": config}).json()["id"]

    def past_a_checkpoint():
        run = api.get(f"/api/v1/runs/{run_id}").json()
        ckpts = api.get(f"/api/v1/runs/{run_id}/checkpoints").json()["data"]
        return run["step"] >= 15 and ckpts

    srv.wait_for(past_a_checkpoint, timeout=240, interval=0.2, what="training past the first checkpoint")
    assert standbys(srv) == ahead, "the run trains in a process started ahead, and none more is started meanwhile"
    for pid in ahead:  # torch is installed here (the merge tests use it), and the training needs none of it,
        # nor the pandas of Tunix's RL trainers
        maps = [m.path for m in psutil.Process(pid).memory_maps()]
        assert not [p for p in maps if "libtorch" in p or "/pandas/" in p], pid
    victims = worker_tree(srv)
    assert any("worker.runs" in " ".join(p.cmdline()) for p in victims), (
        "the training process should be under the worker"
    )
    for proc in victims:
        os.kill(proc.pid, signal.SIGKILL)

    run = wait_run(srv, api, run_id, timeout=300)
    assert run["status"] == "succeeded", (run["error"], srv.log()[-3000:])
    assert run["attempts"] == 2
    assert steps_of(api, run_id) == list(range(1, 61)), "each step once: none twice, none skipped"
    messages = [e["message"] for e in api.get(f"/api/v1/runs/{run_id}/events").json()["data"]]
    assert any(m.startswith("resumed from step ") for m in messages), messages
    assert any("re-queued" in m for m in messages), messages


def test_a_run_lost_before_its_first_checkpoint_starts_over_with_each_step_once(fast_reaper_server):
    """Killed before any checkpoint, the run starts over from step 1: the lost attempt's points are dropped,
    not listed twice (its loss chart and /metrics show each step once)."""
    srv = fast_reaper_server
    api = srv.client()
    dataset = demo_dataset(srv, api)
    config = {**SMALL, "max_steps": 30, "checkpoint_every_steps": 1000}
    run_id = api.post("/api/v1/runs", json={"dataset_id": dataset, "config": config}).json()["id"]
    srv.wait_for(lambda: api.get(f"/api/v1/runs/{run_id}").json()["step"] >= 5, timeout=240, what="step 5")
    for proc in worker_tree(srv):
        with contextlib.suppress(psutil.NoSuchProcess):
            os.kill(proc.pid, signal.SIGKILL)

    run = wait_run(srv, api, run_id, timeout=300)
    assert run["status"] == "succeeded", (run["error"], srv.log()[-3000:])
    assert run["attempts"] == 2
    assert steps_of(api, run_id) == list(range(1, 31)), "each step once: none twice, none skipped"
    messages = [e["message"] for e in api.get(f"/api/v1/runs/{run_id}/events").json()["data"]]
    assert any(m.startswith("started over (no checkpoint)") for m in messages), messages
