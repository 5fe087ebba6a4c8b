"""A run on a pool of multi-host slices: two real workers, each a "host" with its own data dir (the web
app's files out of its sight), joined into one JAX program of 2 processes x 2 CPU devices."""

import contextlib
import fcntl
import hashlib
import os
import time
from pathlib import Path

import psutil
import pytest

from tests.api.test_runs_lifecycle import demo_dataset, steps_of, wait_run
from tests.conftest import ARTIFACTS, start_worker, stop_worker

SLICE_CONFIG = {
    "max_steps": 6,
    "batch_size": 8,
    "max_seq_len": 64,
    "checkpoint_every_steps": 3,
    "eval_every_steps": 3,
    "learning_rate": 0.005,
    "lr_schedule": "constant",
}
SLICE_POOL = {"accelerator": "cpu", "chips": 4, "hosts_per_slice": 2, "price_per_chip_hour": 0}
STALE_S = 6  # the hosts' stale bound: a silent host's run is re-queued after this long
HOST_ENV = {
    # 2 CPU devices each, so that the slice's mesh spans both hosts' devices
    "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=2",
    "TUNEDECK_STALE_SECONDS": str(STALE_S),
    "TUNEDECK_ACCELERATOR_JOBS": "1",  # one accelerator job at a time on each host, as on a TPU host
}


class Slice:
    """Slice s1 of pool cpu-slice: a worker per host, each with a data dir of its own that holds none of the
    web app's files, sharing only the pool's shared directory."""

    def __init__(self, server, root: Path) -> None:
        self.server, self.shared = server, root / "shared"
        self.hosts = [root / "host-0", root / "host-1"]
        self.shared.mkdir()
        self.workers = [self.start(i) for i in range(2)]

    def start(self, index: int):
        return start_worker(
            self.server,
            self.hosts[index],
            "cpu-slice",
            hidden=[self.server.data_dir / "storage", self.server.data_dir / "runs"],
            args=["--slice", "s1", "--host-index", str(index)],
            name=f"host-{index}",
            env=HOST_ENV,
        )

    def wait_complete(self, api) -> None:
        def complete():
            slices = api.get("/api/v1/pools/cpu-slice").json()["slices"]
            return slices and slices[0]["complete"]

        self.server.wait_for(complete, timeout=90, what="both hosts of slice s1")

    def kill(self, index: int) -> None:
        """SIGKILL host ``index``'s worker and everything it started, as a host that dies."""
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.environ().get("TUNEDECK_DATA_DIR") == str(self.hosts[index]):
                    proc.kill()
        self.workers[index].wait()

    @contextlib.contextmanager
    def chips_taken(self, index: int, holder: str):
        """Host ``index``'s chips held by another job, as a job of its own would hold them: the lock file
        of its one slot (worker/leases.py, under /tmp: on the host's own disk) locked by this process."""
        root = Path("/tmp/tunedeck-leases") / hashlib.sha256(str(self.hosts[index].resolve()).encode()).hexdigest()[:12]
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / "chips-0.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            (root / "chips-0.holder").write_text(holder)
            yield
        finally:
            (root / "chips-0.holder").unlink(missing_ok=True)
            os.close(fd)

    def logs(self) -> str:
        return "\n".join((h / "worker.log").read_text(errors="replace")[-2000:] for h in self.hosts)

    def stop(self) -> None:
        for worker, host in zip(self.workers, self.hosts, strict=True):
            stop_worker(worker, host)


@pytest.fixture(scope="module")
def slice_s1(server, api, tmp_path_factory):
    root = tmp_path_factory.mktemp("slice")
    r = api.post("/api/v1/pools", json={"name": "cpu-slice", **SLICE_POOL, "shared_dir": str(root / "shared")})
    assert r.status_code == 201, r.text
    slice_ = Slice(server, root)
    slice_.wait_complete(api)
    yield slice_
    slice_.stop()


def test_a_slice_pool_shows_its_slices_and_the_hosts_of_each(server, api, slice_s1, tmp_path):
    """The two workers, each told its slice and place, show as one complete slice, and each consumes its
    host's own queue; a worker that cannot tell its place does not start."""
    (one,) = api.get("/api/v1/pools/cpu-slice").json()["slices"]
    assert one["name"] == "s1" and one["complete"], one
    hosts = [(w["host_index"], w["hostname"]) for w in one["hosts"]]
    assert hosts == [(0, "cpu-slice@host-0"), (1, "cpu-slice@host-1")]
    for i, host in enumerate(slice_s1.hosts):  # where a slice job's part for that host is sent
        assert f".> cpu-slice.s1.{i} " in (host / "worker.log").read_text()

    # Not a Cloud TPU VM and no place given: the worker says what to give, and does not start.
    lost = start_worker(server, tmp_path / "lost", "cpu-slice", name="lost")
    lost.wait(timeout=60)
    log = (tmp_path / "lost" / "worker.log").read_text()
    assert lost.returncode == 2 and "start its workers with --slice NAME --host-index I" in log, log


def test_a_run_on_a_two_host_slice_trains_across_both(server, api, slice_s1, page):
    dataset = demo_dataset(server, api)

    # A slice pool without a directory its hosts share cannot take runs: refused, naming the pool.
    r = api.post("/api/v1/pools", json={"name": "cpu-slice-bare", **SLICE_POOL})
    assert r.status_code == 201, r.text
    body = {"base_model": "tiny-gemma4", "dataset_id": dataset, "pool": "cpu-slice-bare", "config": SLICE_CONFIG}
    r = api.post("/api/v1/runs", json=body)
    assert r.status_code == 422 and "shared_dir" in r.text and r.json()["detail"][0]["loc"][-1] == "pool", r.text
    r = api.post("/api/v1/pools", json={"name": "cpu-slice-rel", **SLICE_POOL, "shared_dir": "shared"})
    assert r.status_code == 422 and "absolute path" in r.text, r.text

    # Host 1's chips are taken by another job: its part waits, saying so, and the slice starts once
    # they are free. The run trains 4 replicas of the model, one per device (the other slice tests
    # shard it, fsdp=4, the default).
    with slice_s1.chips_taken(1, "endpoint ep-elsewhere"):
        replicas = {**body, "pool": "cpu-slice", "config": {**SLICE_CONFIG, "mesh_dp": 4}}
        r = api.post("/api/v1/runs", json=replicas)
        assert r.status_code == 201, r.text

        def host_1_waits():
            run = api.get(f"/api/v1/runs/{r.json()['id']}").json()
            return [p for p in run["processes"] if p["host_index"] == 1 and p["state"] == "waiting"]

        server.wait_for(host_1_waits, timeout=60, what="host 1's part to wait for its chips")
    run = wait_run(server, api, r.json()["id"], timeout=400)
    assert run["status"] == "succeeded", (run["error"], slice_s1.logs())
    assert (run["config"]["mesh_dp"], run["config"]["mesh_fsdp"], run["config"]["mesh_tp"]) == (4, 1, 1)

    # One JAX program over both hosts, recorded by process 0; each fed half of every batch.
    events = api.get(f"/api/v1/runs/{run['id']}/events", params={"limit": 500}).json()["data"]
    messages = [e["message"] for e in events]
    (joined,) = [m for m in messages if "jax.process_count() == 2" in m]
    assert "each process feeds 4 of the 8 rows" in joined, joined
    assert any("host 1 of slice s1 (cpu-slice@host-1) is joining" in m for m in messages), messages
    assert "mesh: dp=4 x fsdp=1 x tp=1 over 4 devices (4 replicas: one gradient sum a step)" in messages
    waited = [m for m in messages if m.startswith("host 1 of slice s1: waiting for chips on host ")]
    assert len(waited) == 1 and waited[0].endswith(": held by endpoint ep-elsewhere"), messages
    assert run["attempts"] == 1  # waiting for chips took no attempt
    assert steps_of(api, run["id"]) == [1, 2, 3, 4, 5, 6]

    # Its checkpoints were saved once, into the shared directory, by both processes together.
    ckpts = server.sql("SELECT step, path FROM run_checkpoints WHERE run_id = :r ORDER BY step", r=run["id"])
    run_shared = slice_s1.shared / "runs" / run["id"] / "checkpoints"
    assert [tuple(c) for c in ckpts] == [(s, str(run_shared / str(s))) for s in (3, 6)]
    assert sorted(p.name for p in run_shared.iterdir() if p.name.isdigit()) == ["3", "6"]
    for host in slice_s1.hosts:
        assert not list(Path(host).rglob("model_params")), f"{host} holds checkpoint files of its own"
        # the dataset reached each host through the web app (its storage is out of their sight)
        assert (host / "cache" / "datasets" / dataset / "data").is_file()

    # The run shows its slice and each host's process with its own step time (host 1's last word may
    # come a moment after host 0 has recorded the run's end).
    assert run["slice"] == "s1"
    run = server.wait_for(
        lambda: (r := api.get(f"/api/v1/runs/{run['id']}").json())["processes"][1]["state"] != "training" and r,
        timeout=10,
        what="host 1's process to end",
    )
    processes = run["processes"]
    assert [(p["host_index"], p["worker"], p["state"], p["step"]) for p in processes] == [
        (0, "cpu-slice@host-0", "done", 6),
        (1, "cpu-slice@host-1", "done", 6),
    ], processes
    assert all(p["step_time_s"] > 0 and p["attempt"] == run["attempts"] for p in processes), processes

    # Its page shows the slice: a row per host, with the host's worker, step and step time.
    page.goto(f"/runs/{run['id']}")
    card = page.locator("#run-slice")
    card.wait_for(state="visible")
    assert card.locator("h2").inner_text() == "Slice s1"
    rows = card.locator("tbody tr")
    assert rows.count() == 2
    for i, p in enumerate(processes):
        cells = rows.nth(i).locator("td").all_inner_texts()
        assert cells[:4] == [f"{i}{' (coordinator)' if i == 0 else ''}", p["worker"], "done", "6"], cells
        assert cells[4].startswith(f"{round(p['step_time_s'] * 1000):,}") and cells[4].split()[1] == "ms", cells
    card.screenshot(path=str(ARTIFACTS / "run-slice.png"))


def test_a_host_killed_mid_run_stops_the_slice_and_the_run_resumes_from_its_checkpoint(server, api, slice_s1):
    dataset = demo_dataset(server, api)
    config = {**SLICE_CONFIG, "max_steps": 20, "checkpoint_every_steps": 10, "eval_every_steps": 10}
    r = api.post("/api/v1/runs", json={"dataset_id": dataset, "pool": "cpu-slice", "config": config})
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]

    def past_a_checkpoint():
        run = api.get(f"/api/v1/runs/{run_id}").json()
        return run["step"] >= 13 and api.get(f"/api/v1/runs/{run_id}/checkpoints").json()["data"]

    server.wait_for(past_a_checkpoint, timeout=300, interval=0.2, what="training past the first checkpoint")
    slice_s1.kill(1)
    killed = time.monotonic()

    # Host 0 sees host 1 fall silent within the stale bound (and a beat or two), and stops its own
    # process with the run, which goes back on the queue.
    def requeued():
        events = api.get(f"/api/v1/runs/{run_id}/events", params={"limit": 500}).json()["data"]
        return [e for e in events if "host 1 of slice s1 stopped answering: re-queued" in e["message"]]

    server.wait_for(requeued, timeout=STALE_S + 20, what="host 0 to give up on host 1")
    assert time.monotonic() - killed < STALE_S + 8
    slice_s1.workers[1] = slice_s1.start(1)  # the host comes back

    run = wait_run(server, api, run_id, timeout=400)
    assert run["status"] == "succeeded", (run["error"], slice_s1.logs())
    assert (run["attempts"], run["slice"]) == (2, "s1")
    assert steps_of(api, run_id) == list(range(1, 21)), "each step once: none twice, none skipped"
    messages = [e["message"] for e in api.get(f"/api/v1/runs/{run_id}/events", params={"limit": 500}).json()["data"]]
    assert any(m.startswith("resumed from step 10") for m in messages), messages
    assert [p["attempt"] for p in run["processes"]] == [2, 2]
    assert server.sql("SELECT lost_attempts FROM runs WHERE id = :r", r=run_id)[0][0] == 1, (
        "one lost attempt, for the slice as a whole"
    )


def test_a_stopping_host_hands_the_slice_run_back_at_one_step(server, api, slice_s1):
    """SIGTERM to host 1's worker (a restart, a deploy, a preempted host): host 0's process decides the stop
    once and broadcasts it, both processes save one checkpoint at the same step and stop, and the run goes
    back on the queue, no attempt lost; it resumes there once host 1 is back."""
    dataset = demo_dataset(server, api)
    config = {**SLICE_CONFIG, "max_steps": 20, "checkpoint_every_steps": 50, "eval_every_steps": 50}
    r = api.post("/api/v1/runs", json={"dataset_id": dataset, "pool": "cpu-slice", "config": config})
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    server.wait_for(lambda: api.get(f"/api/v1/runs/{run_id}").json()["step"] >= 4, timeout=300, what="step 4")
    slice_s1.workers[1].terminate()

    def handed_back():
        events = api.get(f"/api/v1/runs/{run_id}/events", params={"limit": 500}).json()["data"]
        return [e["message"] for e in events if e["message"].startswith("handed back at step ")]

    (said,) = server.wait_for(handed_back, timeout=60, what="the run handed back")
    step = int(said.split()[4].rstrip(","))
    slice_s1.workers[1].wait(timeout=60)
    messages = [e["message"] for e in api.get(f"/api/v1/runs/{run_id}/events", params={"limit": 500}).json()["data"]]
    assert "cpu-slice@host-1 (host 1 of slice s1) is stopping: saving a checkpoint to hand the run back" in messages
    assert [c["step"] for c in api.get(f"/api/v1/runs/{run_id}/checkpoints").json()["data"]] == [step]
    slice_s1.workers[1] = slice_s1.start(1)  # the host comes back

    run = wait_run(server, api, run_id, timeout=400)
    assert run["status"] == "succeeded", (run["error"], slice_s1.logs())
    assert steps_of(api, run_id) == list(range(1, 21)), "each step once: none twice, none skipped"
    messages = [e["message"] for e in api.get(f"/api/v1/runs/{run_id}/events", params={"limit": 500}).json()["data"]]
    assert any(m.startswith(f"resumed from step {step}") for m in messages), messages
    # The hand-back itself lost no attempt: nothing was re-queued as lost before it. (While host 1 comes
    # back, this module's 6 s stale bound may re-queue a start that a loaded machine makes slow.)
    oldest_first = messages[::-1]
    handed = oldest_first.index(said)
    stopping = "cpu-slice@host-1 (host 1 of slice s1) is stopping: saving a checkpoint to hand the run back"
    assert oldest_first.index(stopping) < handed, oldest_first
    assert not [m for m in oldest_first[:handed] if m.endswith(": re-queued")], oldest_first
