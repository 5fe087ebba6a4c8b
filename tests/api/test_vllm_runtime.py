"""The vLLM container runtimes of TPU and GPU pools: the exact container asked of Docker, and what an
endpoint's supervisor asks of the Docker Engine API through the `docker` SDK, against a stand-in of
that API served by the test (pull, create, start, inspect, logs, stop, remove; a container that dies
of OOM). No Docker engine runs here: readiness, probes and metrics scraping, which speak vLLM's own
protocol, are tested against the built-in server (test_endpoints.py)."""

import json
import os
import struct
import subprocess
import sys
import threading
import time

import psutil
import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from app.artifacts.models import Artifact, ArtifactKind
from app.base_models.presets import BASE_MODELS
from app.core.config import get_settings
from app.endpoints.models import Endpoint, Runtime
from app.endpoints.service import replica_problem
from app.pools.models import Pool
from tests.api.test_endpoints import wait_endpoint
from tests.conftest import ROOT, free_port
from worker.runtimes import container_spec

API = "1.47"


@pytest.fixture
def settings(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEDECK_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TUNEDECK_HF_TOKEN", "hf_secret")
    get_settings.cache_clear()
    yield get_settings()
    get_settings.cache_clear()


# vLLM's parallel layout: data_parallel_size replicas, each over chips / data_parallel_size by tensor
# parallelism. The published Trillium recipe for gemma-4-31B-it (AI-Hypercomputer/tpu-recipes,
# inference/trillium/vLLM/Gemma4) serves it on a v6e-8 with --tensor-parallel-size 8 and names 4 chips the
# minimum; a TP=4 x DP=2 configuration of it could not be confirmed from a published source.
@pytest.mark.parametrize(("replicas", "layout"), [(1, ["8"]), (2, ["4", "--data-parallel-size", "2"])])
def test_vllm_tpu_container_for_a_31b_merge_on_a_v6e_8(settings, replicas, layout):
    pool = Pool(name="tpu-v6e-8", accelerator="tpu-v6e-8", chips=8, price_per_chip_hour=2.7)
    artifact = Artifact(
        id="art-31b",
        owner_id=1,
        run_id="run-31b",
        kind=ArtifactKind.merged,
        checkpoint_step=500,
        name="ft:gemma4-31b:support:run-31b",
        path="gs://models-bucket/tunedeck/artifacts/art-31b",  # kept in a store: Docker cannot mount it
    )
    endpoint = Endpoint(
        id="ep-31b",
        owner_id=1,
        artifact_id=artifact.id,
        model=artifact.name,
        pool=pool.name,
        runtime=Runtime.vllm_tpu,
        settings={"max_model_len": 16384, "max_num_seqs": 64, "data_parallel_size": replicas},
        api_key="key-of-ep-31b",
    )
    # this host's copy of it (worker.model_cache.local_artifact) is what the container mounts
    spec = container_spec(
        endpoint, artifact, pool, model_dir="/srv/tunedeck/cache/artifacts/art-31b", host="10.0.0.7", port=8101
    )
    cache = str(settings.data_dir / "cache" / "vllm")
    assert spec == {
        "image": "vllm/vllm-tpu:latest",
        "name": "tunedeck-ep-31b",
        "entrypoint": ["vllm", "serve"],
        "command": [
            "/models/art-31b",
            "--served-model-name",
            "ft:gemma4-31b:support:run-31b",
            "--tensor-parallel-size",
            *layout,
            "--max-model-len",
            "16384",
            "--max-num-seqs",
            "64",
            "--host",
            "10.0.0.7",
            "--port",
            "8101",
        ],
        "environment": {
            "HF_HOME": "/cache/huggingface",
            "VLLM_XLA_CACHE_PATH": "/cache/vllm-xla",
            "JAX_COMPILATION_CACHE_DIR": "/cache/jax",
            "HF_TOKEN": "hf_secret",
            # vLLM answers /v1 (and, in newer releases, /metrics) only with this bearer; given in the
            # environment, not as --api-key, so that it is in neither `ps` nor vLLM's log of its arguments
            "VLLM_API_KEY": "key-of-ep-31b",
        },
        "volumes": {
            cache: {"bind": "/cache", "mode": "rw"},
            "/dev/shm": {"bind": "/dev/shm", "mode": "rw"},
            "/srv/tunedeck/cache/artifacts/art-31b": {"bind": "/models/art-31b", "mode": "ro"},
        },
        "network_mode": "host",
        "shm_size": "16g",
        "labels": {"tunedeck.endpoint": "ep-31b", "tunedeck.artifact": "art-31b"},
        "privileged": True,
    }
    assert os.path.isdir(cache)  # the compile caches survive the container


def test_a_replica_must_hold_the_models_weights_on_its_chips():
    """31B in bfloat16 (its preset's parameters x 2 bytes, 57 GiB) on a v6e-8: a v6e chip shows JAX 31.25
    GiB, 28.1 GiB of it usable; a replica over 4 chips holds 14.3 GiB per chip, over 2 chips 28.6 GiB."""
    weights = 2 * BASE_MODELS["gemma-4-31b"].arch.params()
    v6e = Pool(name="tpu-v6e-8", accelerator="tpu-v6e-8", chips=8, price_per_chip_hour=2.7)
    assert replica_problem(weights, v6e, 1) is None and replica_problem(weights, v6e, 2) is None
    problem = replica_problem(weights, v6e, 4)
    assert problem is not None and "28.6 GiB" in problem and "use data_parallel_size 2 or less" in problem
    assert "must divide them (1, 2, 4, 8)" in (replica_problem(weights, v6e, 3) or "")
    v5e = Pool(name="tpu-v5e-4", accelerator="tpu-v5e-8", chips=2, price_per_chip_hour=1.2)  # 16 GB a chip
    assert "does not fit pool tpu-v5e-4" in (replica_problem(weights, v5e, 1) or "")


def test_vllm_gpu_container_serves_an_adapter_on_its_base(settings):
    pool = Pool(name="h100", accelerator="gpu-h100x2", chips=2, price_per_chip_hour=3.0)
    artifact = Artifact(
        id="art-lora",
        owner_id=1,
        run_id="run-1",
        kind=ArtifactKind.adapter,
        checkpoint_step=6,
        name="ft:tiny:adapter",
        path="/data/artifacts/art-lora",
        verification={"lora_rank": 24},
    )
    endpoint = Endpoint(
        id="ep-lora",
        owner_id=1,
        artifact_id=artifact.id,
        model=artifact.name,
        pool=pool.name,
        runtime=Runtime.vllm_gpu,
        settings={"max_model_len": 2048, "max_num_seqs": 8},
        api_key="key-of-ep-lora",
    )
    spec = container_spec(
        endpoint, artifact, pool, model_dir=artifact.path, host="127.0.0.1", port=9000, base_dir="/data/models/gemma4"
    )
    assert spec["image"] == "vllm/vllm-openai:latest"
    assert spec["command"][:7] == [
        "/models/base",
        "--enable-lora",
        "--lora-modules",
        "ft:tiny:adapter=/models/art-lora",
        "--max-lora-rank",
        "32",  # the smallest rank vLLM accepts that holds 24
        "--tensor-parallel-size",
    ]
    assert spec["volumes"]["/data/models/gemma4"] == {"bind": "/models/base", "mode": "ro"}
    assert spec["device_requests"] == [{"count": -1, "capabilities": [["gpu"]]}] and spec["ipc_mode"] == "host"
    assert "privileged" not in spec and "MODEL_IMPL_TYPE" not in spec["environment"]
    assert spec["environment"]["VLLM_API_KEY"] == "key-of-ep-lora" and "--api-key" not in spec["command"]


class DockerStandIn:
    """The few Docker Engine API calls the runtime makes, answered as dockerd would, and recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.bodies: dict[str, dict] = {}
        self.images: set[str] = set()
        self.containers: dict[str, dict] = {}
        self.created = 0
        self.listing_refused = False  # while set, listing containers fails as an engine that is down would
        self.app = FastAPI()
        self.app.add_api_route("/{path:path}", self.handle, methods=["GET", "POST", "DELETE"])

    def container(self, name: str) -> dict:
        return next(c for c in self.containers.values() if c["Name"] == "/" + name)

    async def handle(self, path: str, request: Request) -> Response:
        path = "/" + path.removeprefix(f"v{API}/")
        q = request.query_params
        filters = json.loads(q.get("filters") or "{}")
        # A listing is recorded with what it filters by: the supervisor's by name, the worker's by label.
        self.calls.append((request.method, path + "".join(f"?{k}" for k in sorted(filters))))
        if path == "/version":
            return JSONResponse({"ApiVersion": API, "MinAPIVersion": "1.24", "Version": "27.3.1"})
        if path.startswith("/images/") and path.endswith("/json"):
            name = path.removeprefix("/images/").removesuffix("/json")
            if name not in self.images:
                return JSONResponse({"message": f"No such image: {name}"}, 404)
            return JSONResponse({"Id": "sha256:" + "ab" * 32, "RepoTags": [name]})
        if path == "/images/create":
            image = f"{q['fromImage']}:{q['tag']}"
            self.images.add(image)
            lines = [{"status": f"Pulling from {q['fromImage']}", "id": q["tag"]}, {"status": f"Downloaded {image}"}]
            return StreamingResponse((json.dumps(x) + "\r\n" for x in lines), media_type="application/json")
        if path == "/containers/json":
            if self.listing_refused:
                return JSONResponse({"message": "the engine is unavailable"}, 500)
            listed = [
                {"Id": c["Id"], "Names": [c["Name"]], "Labels": c["Config"]["Labels"], "State": c["State"]["Status"]}
                for c in self.containers.values()
                if (q.get("all") or c["State"]["Running"])
                and all(n in c["Name"] for n in filters.get("name", []))
                and all(label in c["Config"]["Labels"] for label in filters.get("label", []))
            ]
            return JSONResponse(listed)
        if path == "/containers/create":
            if any(c["Name"] == "/" + q["name"] for c in self.containers.values()):
                return JSONResponse({"message": f'Conflict. The container name "/{q["name"]}" is already in use'}, 409)
            self.created += 1
            cid = f"{self.created:064x}"
            body = await request.json()
            self.bodies[cid] = body
            self.containers[cid] = {
                "Id": cid,
                "Name": "/" + q["name"],
                "Config": {**body, "Tty": False},
                "State": {"Status": "created", "Running": False, "ExitCode": 0, "OOMKilled": False},
                "logs": [],
            }
            return JSONResponse({"Id": cid, "Warnings": []}, 201)
        cid, _, action = path.removeprefix("/containers/").partition("/")
        c = self.containers.get(cid)
        if c is None:
            return JSONResponse({"message": f"No such container: {cid}"}, 404)
        if request.method == "DELETE":
            del self.containers[cid]
            return Response(status_code=204)
        if action == "json":
            return JSONResponse({k: v for k, v in c.items() if k != "logs"})
        if action == "start":
            c["State"].update(Status="running", Running=True)
            c["logs"] += ["INFO Loading model weights...", "INFO Model loading took 57.1 GiB and 41.2 seconds"]
            c["logs"] += ["INFO Compiling the model with different input shapes..."]
            return Response(status_code=204)
        if action == "stop":
            c["State"].update(Status="exited", Running=False, ExitCode=0)
            return Response(status_code=204)
        if action == "logs":  # stdout frames: 1, 0, 0, 0, big-endian length, then the bytes
            tail = c["logs"][-int(q.get("tail", "1000")) :]
            data = b"".join(struct.pack(">BxxxL", 1, len(x) + 1) + x.encode() + b"\n" for x in tail)
            return Response(data, media_type="application/vnd.docker.raw-stream")
        return JSONResponse({"message": f"not in the stand-in: {request.method} {path}"}, 501)


@pytest.fixture(scope="module")
def docker_engine():
    engine = DockerStandIn()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(engine.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    engine.url = f"tcp://127.0.0.1:{port}"
    yield engine
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def tpu_worker(server, api, docker_engine):
    """A worker of the tpu-v6e-8 pool on this machine, its Docker Engine the stand-in."""
    env = {**server.env, "TUNEDECK_DOCKER_HOST": docker_engine.url}
    log = open(server.data_dir / "tpu-worker.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "worker", "--pool", "tpu-v6e-8"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server.wait_for(
        lambda: api.get("/api/v1/pools/tpu-v6e-8").json()["workers_online"] >= 1, timeout=90, what="the tpu worker"
    )
    yield proc
    proc.terminate()
    proc.wait(timeout=60)
    log.close()


def test_a_tpu_endpoint_runs_vllm_through_the_docker_engine_api(server, api, artifact, docker_engine, tpu_worker):
    r = api.post("/api/v1/endpoints", json={"artifact_id": artifact["id"], "pool": "tpu-v6e-8", "max_model_len": 4096})
    assert r.status_code == 201, r.text
    endpoint = r.json()
    assert endpoint["runtime"] == "vllm-tpu" and endpoint["status"] == "pending"
    ep = endpoint["id"]

    # The image is pulled (the host lacked it), the container created and started; its log says compiling.
    endpoint = server.wait_for(
        lambda: (e := api.get(f"/api/v1/endpoints/{ep}").json())["phase"] == "compiling" and e,
        timeout=120,
        what="the compiling phase",
    )
    assert endpoint["status"] == "starting" and endpoint["url"].startswith("http://127.0.0.1:")
    container = docker_engine.container(f"tunedeck-{ep}")
    body = docker_engine.bodies[container["Id"]]
    port = endpoint["url"].rsplit(":", 1)[1]
    assert body["Image"] == "vllm/vllm-tpu:latest" and body["Entrypoint"] == ["vllm", "serve"]
    assert body["Cmd"] == [
        f"/models/{artifact['id']}",
        "--served-model-name",
        artifact["name"],
        "--tensor-parallel-size",
        "8",
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "16",
        "--host",
        "127.0.0.1",
        "--port",
        port,
        "--reasoning-parser",  # the artifact's tokenizer names Gemma 4's thought channel
        "gemma4",
    ]
    keys = [v.removeprefix("VLLM_API_KEY=") for v in body["Env"] if v.startswith("VLLM_API_KEY=")]
    assert len(keys) == 1 and len(keys[0]) >= 32, "the container is started with a key of its own"
    assert keys[0] not in " ".join(body["Cmd"]) and keys[0] not in api.get(f"/api/v1/endpoints/{ep}").text
    host = body["HostConfig"]
    assert host["NetworkMode"] == "host" and host["Privileged"] is True and host["ShmSize"] == 16 * 1024**3
    assert f"{artifact['path']}:/models/{artifact['id']}:ro" in host["Binds"]
    assert "/dev/shm:/dev/shm:rw" in host["Binds"]
    assert body["Labels"] == {"tunedeck.endpoint": ep, "tunedeck.artifact": artifact["id"]}
    logs = server.wait_for(
        lambda: "Compiling the model" in (t := api.get(f"/api/v1/endpoints/{ep}/logs").text) and t,
        timeout=30,
        what="the log tail",
    )
    assert logs.splitlines()[0] == "INFO Loading model weights..."

    # Stop: the container is stopped, then removed.
    assert api.post(f"/api/v1/endpoints/{ep}/stop").json()["status"] == "stopping"
    endpoint = wait_endpoint(server, api, ep, ("stopped", "failed"), timeout=60)
    assert endpoint["status"] == "stopped", endpoint["error"]
    cid = container["Id"]
    relevant = [(m, p) for m, p in docker_engine.calls if p not in ("/version", "/containers/json?label")]
    made = [(m, p) for m, p in relevant if not p.endswith(f"{cid}/json")]  # the worker's look for orphans aside
    assert made[:4] == [
        ("GET", "/images/vllm/vllm-tpu:latest/json"),
        ("POST", "/images/create"),
        ("GET", "/images/vllm/vllm-tpu:latest/json"),
        ("GET", "/containers/json?name"),  # a dead supervisor's container of the endpoint, to remove first
    ]
    assert made[4:6] == [("POST", "/containers/create"), ("POST", f"/containers/{cid}/start")]
    # stopped, then removed; the worker's look for orphans may remove it again once the endpoint is
    # recorded stopped, if it listed the container just before (the engine answers 404, which it ignores)
    stopped_at = made.index(("POST", f"/containers/{cid}/stop"))
    assert made[stopped_at + 1 :] in ([("DELETE", f"/containers/{cid}")], [("DELETE", f"/containers/{cid}")] * 2)
    assert ("GET", f"/containers/{cid}/logs") in made and ("GET", f"/containers/{cid}/json") in docker_engine.calls
    assert cid not in docker_engine.containers

    # Restart: a new container from the image now on the host, which dies of OOM while compiling.
    calls = len(docker_engine.calls)
    r = api.post(f"/api/v1/endpoints/{ep}/restart")
    assert r.status_code == 200 and r.json()["status"] == "pending", r.text
    assert api.post(f"/api/v1/endpoints/{ep}/restart").status_code == 409  # active: stop it first
    server.wait_for(lambda: api.get(f"/api/v1/endpoints/{ep}").json()["phase"] == "compiling", timeout=60)
    assert ("POST", "/images/create") not in docker_engine.calls[calls:]
    again = docker_engine.container(f"tunedeck-{ep}")
    again["logs"].append("ERROR RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in hbm")
    again["State"].update(Status="exited", Running=False, ExitCode=137, OOMKilled=True)
    endpoint = wait_endpoint(server, api, ep, ("failed", "stopped"), timeout=60)
    assert endpoint["status"] == "failed"
    assert endpoint["error"] == (
        "the vLLM container exited with code 137 (out of memory): "
        "ERROR RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in hbm"
    )
    server.wait_for(  # then removed (the endpoint failed first), its output kept on the endpoint
        lambda: again["Id"] not in docker_engine.containers, timeout=10, what="the dead container's removal"
    )
    assert "Ran out of memory in hbm" in api.get(f"/api/v1/endpoints/{ep}/logs").text


def _supervisor(server, endpoint_id: str) -> psutil.Process:
    ((pid,),) = server.sql("SELECT pid FROM endpoints WHERE id = :id", id=endpoint_id)
    proc = psutil.Process(pid)
    assert proc.cmdline()[-3:-1] == ["worker.endpoints", endpoint_id], proc.cmdline()
    return proc


def _lose_supervisor(server, api, endpoint_id: str) -> dict:
    """Kill the endpoint's supervisor (the OOM killer, kill -9) and make it silent for longer than the
    stale bound, as the pool's workers see it once that time has passed: its endpoint fails."""
    _supervisor(server, endpoint_id).kill()
    server.sql("UPDATE endpoints SET heartbeat_at = '2000-01-01 00:00:00' WHERE id = :id", id=endpoint_id)
    failed = wait_endpoint(server, api, endpoint_id, ("failed",), timeout=30)
    assert failed["error"].startswith("no heartbeat from tpu-v6e-8@"), failed["error"]
    return failed


def _key(docker_engine, container: dict) -> str:
    env = docker_engine.bodies[container["Id"]]["Env"]
    return next(v.removeprefix("VLLM_API_KEY=") for v in env if v.startswith("VLLM_API_KEY="))


def test_a_dead_supervisors_container_is_removed(server, api, artifact, docker_engine, tpu_worker):
    """A supervisor that dies leaves its vLLM container running (Docker kills nothing with it), holding the
    host's chips. Its worker removes the container once the endpoint is no longer live: failed, deleted,
    or started again (with a new key)."""
    r = api.post("/api/v1/endpoints", json={"artifact_id": artifact["id"], "pool": "tpu-v6e-8"})
    assert r.status_code == 201, r.text
    ep = r.json()["id"]

    def compiling():
        return api.get(f"/api/v1/endpoints/{ep}").json()["phase"] == "compiling"

    server.wait_for(compiling, timeout=60, what="the compiling phase")
    first = docker_engine.container(f"tunedeck-{ep}")
    _lose_supervisor(server, api, ep)
    server.wait_for(lambda: first["Id"] not in docker_engine.containers, timeout=10, what="the orphan's removal")

    # Started again: a new container with a new key; then lost too, while the engine is unreachable.
    assert api.post(f"/api/v1/endpoints/{ep}/restart").status_code == 200
    server.wait_for(compiling, timeout=60, what="the compiling phase after the restart")
    second = docker_engine.container(f"tunedeck-{ep}")
    assert second["Id"] != first["Id"] and _key(docker_engine, second) != _key(docker_engine, first)
    docker_engine.listing_refused = True
    try:
        _lose_supervisor(server, api, ep)
        time.sleep(1.5)  # a beat or two, which cannot list the engine's containers
        assert second["Id"] in docker_engine.containers and second["State"]["Running"]
        # Deleted: the container goes as soon as the engine answers again.
        assert api.delete(f"/api/v1/endpoints/{ep}").status_code == 204
    finally:
        docker_engine.listing_refused = False
    server.wait_for(lambda: second["Id"] not in docker_engine.containers, timeout=10, what="the orphan's removal")
    assert [c["Name"] for c in docker_engine.containers.values()] == []
