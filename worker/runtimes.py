"""Model server runtimes: how an endpoint's model server is started, watched and stopped on a worker's host.

- ``local`` (the cpu pool): the built-in model server, ``python -m worker.serve``, a child process.
- ``vllm-tpu`` and ``vllm-gpu`` (TPU and GPU pools): vLLM's container, through the Docker Engine API
  (the ``docker`` SDK), on the host's network, so it listens on the worker's host as the local server
  does. ``container_spec`` is the whole of what is asked of Docker.

Both speak vLLM's API and metrics, so the supervisor (worker/endpoints.py) treats them alike: ``start``,
``exit_reason`` (None while it runs), ``log`` (the tail of its output, where ``phase_of`` reads how far
it has got) and ``stop``. A container outlives a supervisor that dies (its host's other processes kill
nothing in Docker): ``remove_orphans``, on each beat of a TPU or GPU pool's worker, removes the containers
no endpoint runs any more.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Protocol

from app.artifacts.models import Artifact, ArtifactKind
from app.core.config import get_settings
from app.endpoints import service as endpoints
from app.endpoints.models import Endpoint, Runtime
from app.evaluations import service as evaluations
from app.pools.models import Pool
from worker import processes
from worker.chat import vllm_reasoning_parser

STOP_GRACE_S = 20.0
LOG_BYTES = 64 * 1024  # the tail of a model server's output that is read for phases and shown
LOG_LINES = 200
PHASE_PREFIX = "tunedeck-phase: "  # what the built-in model server prints as it goes (worker/serve/server.py)
# vLLM's own log lines, newest wins: weights loading, XLA / torch.compile compiling, CUDA graphs warming up
VLLM_PHASES = (
    (re.compile(r"captur|warm", re.I), "warming up"),
    (re.compile(r"compil", re.I), "compiling"),
    (re.compile(r"load", re.I), "loading"),
)
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's --max-lora-rank accepts
CONTAINER_MODELS = "/models"
CONTAINER_CACHE = "/cache"
ENDPOINT_LABEL = "tunedeck.endpoint"  # on each container: the endpoint it serves


class ModelServer(Protocol):
    def start(self, on_phase) -> None: ...
    def exit_reason(self) -> str | None: ...
    def log(self) -> str: ...
    def phase_of(self, line: str) -> str | None: ...
    def stop(self) -> None: ...


def model_server(
    endpoint: Endpoint,
    artifact: Artifact,
    pool: Pool | None,
    *,
    model_dir: str,
    host: str,
    port: int,
    log: Path,
    base_dir: str | None,
) -> ModelServer:
    """The model server of an endpoint serving ``artifact``, whose files are in ``model_dir`` on this host
    (worker.model_cache.local_artifact)."""
    if endpoint.runtime == Runtime.local:
        return LocalServer(endpoint, model_dir, host=host, port=port, log=log)
    if pool is None:  # deleted since the endpoint was deployed (an endpoint does not hold its pool)
        raise ValueError(f"pool {endpoint.pool!r} no longer exists: vLLM is started on its pool's chips")
    spec = container_spec(endpoint, artifact, pool, model_dir=model_dir, host=host, port=port, base_dir=base_dir)
    return VllmContainer(spec, log=log)


def _last_line(text: str, skip: str | None = None) -> str:
    lines = [line for line in text.splitlines() if line.strip() and not (skip and line.startswith(skip))]
    return lines[-1][:500] if lines else "(no output)"


def _key(endpoint: Endpoint) -> str:
    if not endpoint.api_key:
        raise ValueError(f"endpoint {endpoint.id} has no key: its model server is started with one (endpoints.start)")
    return endpoint.api_key


class LocalServer:
    """The built-in model server as a child of the supervisor, its output in ``log``. Its key goes in its
    environment (``VLLM_API_KEY``, as for vLLM), which only its user can read, not on its command line."""

    def __init__(self, endpoint: Endpoint, model_dir: str, *, host: str, port: int, log: Path) -> None:
        self.command = [sys.executable, "-m", "worker.serve", "--model", model_dir]
        self.command += ["--served-model-name", endpoint.model, "--host", host, "--port", str(port)]
        self.command += ["--max-model-len", str(endpoint.settings["max_model_len"])]
        self.command += ["--max-num-seqs", str(endpoint.settings["max_num_seqs"])]
        self.env = {**os.environ, "VLLM_API_KEY": _key(endpoint)}
        self.path = log
        self.child: subprocess.Popen | None = None

    def start(self, on_phase) -> None:
        on_phase("loading")
        with open(self.path, "ab") as out:
            self.child = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                preexec_fn=processes.die_with_parent,
            )

    def exit_reason(self) -> str | None:
        assert self.child is not None, "asked after start()"
        code = self.child.poll()
        if code is None:
            return None
        return f"the model server {processes.exit_reason(code)}: {_last_line(self.log(), skip=PHASE_PREFIX)}"

    def log(self) -> str:
        if not self.path.exists():
            return ""
        with open(self.path, "rb") as f:
            f.seek(max(0, self.path.stat().st_size - LOG_BYTES))
            return f.read().decode(errors="replace")

    def phase_of(self, line: str) -> str | None:
        return line.removeprefix(PHASE_PREFIX).strip() if line.startswith(PHASE_PREFIX) else None

    def stop(self) -> None:
        if self.child is not None:
            processes.stop(self.child, STOP_GRACE_S)


def container_spec(
    endpoint: Endpoint,
    artifact: Artifact,
    pool: Pool,
    *,
    model_dir: str,
    host: str,
    port: int,
    base_dir: str | None = None,
) -> dict:
    """The keyword arguments of ``docker.containers.create`` for the endpoint's vLLM container.

    The artifact's files are mounted from ``model_dir``, its directory on this host. A merged artifact is
    served as it is; an adapter is served on its base (``base_dir``) with
    ``--enable-lora``, under the endpoint's model name. The compile caches live in a volume under the
    data dir, so a restart does not compile again (a cold start of 31B compiles for about 10 minutes).
    The endpoint's key is ``VLLM_API_KEY`` (vLLM reads it when no ``--api-key`` is given): not in the
    command, which ``ps`` on the host and vLLM's own log of its arguments would show."""
    settings = get_settings()
    tpu = endpoint.runtime == Runtime.vllm_tpu
    cache = settings.data_dir / "cache" / "vllm"
    cache.mkdir(parents=True, exist_ok=True)
    mounted = f"{CONTAINER_MODELS}/{artifact.id}"
    volumes = {
        str(cache): {"bind": CONTAINER_CACHE, "mode": "rw"},
        "/dev/shm": {"bind": "/dev/shm", "mode": "rw"},
    }
    args: list[str]
    if artifact.kind == ArtifactKind.adapter:
        if base_dir is None:
            raise ValueError(f"artifact {artifact.id} is an adapter: its base model's directory is needed")
        rank = int((artifact.verification or {}).get("lora_rank") or endpoint.settings.get("lora_rank") or 16)
        volumes[base_dir] = {"bind": f"{CONTAINER_MODELS}/base", "mode": "ro"}
        volumes[model_dir] = {"bind": mounted, "mode": "ro"}
        args = [f"{CONTAINER_MODELS}/base", "--enable-lora", "--lora-modules", f"{endpoint.model}={mounted}"]
        args += ["--max-lora-rank", str(next(r for r in LORA_RANKS if r >= rank))]
    else:
        volumes[model_dir] = {"bind": mounted, "mode": "ro"}
        args = [mounted, "--served-model-name", endpoint.model]
    replicas = int(endpoint.settings.get("data_parallel_size") or 1)  # vLLM: dp replicas of tp chips each
    args += ["--tensor-parallel-size", str(pool.chips // replicas)]
    if replicas > 1:
        args += ["--data-parallel-size", str(replicas)]
    args += ["--max-model-len", str(endpoint.settings["max_model_len"])]
    args += ["--max-num-seqs", str(endpoint.settings["max_num_seqs"])]
    args += ["--host", host, "--port", str(port)]
    parser = vllm_reasoning_parser(base_dir if artifact.kind == ArtifactKind.adapter and base_dir else model_dir)
    if parser:  # thoughts come back as reasoning_content, as from the built-in server
        args += ["--reasoning-parser", parser]
    environment = {
        "HF_HOME": f"{CONTAINER_CACHE}/huggingface",
        "VLLM_XLA_CACHE_PATH": f"{CONTAINER_CACHE}/vllm-xla",
        "JAX_COMPILATION_CACHE_DIR": f"{CONTAINER_CACHE}/jax",
        "VLLM_API_KEY": _key(endpoint),
    }
    if tpu and artifact.kind == ArtifactKind.adapter:
        environment["MODEL_IMPL_TYPE"] = "vllm"  # LoRA runs on vLLM's PyTorch model path on TPU
    if settings.hf_token is not None:
        environment["HF_TOKEN"] = settings.hf_token.get_secret_value()
    spec = {
        "image": settings.vllm_tpu_image if tpu else settings.vllm_gpu_image,
        "name": f"tunedeck-{endpoint.id}",
        "entrypoint": ["vllm", "serve"],
        "command": args,
        "environment": environment,
        "volumes": volumes,
        "network_mode": "host",
        "shm_size": settings.vllm_shm_size,
        "labels": {ENDPOINT_LABEL: endpoint.id, "tunedeck.artifact": artifact.id},
    }
    if tpu:
        spec["privileged"] = True  # the TPU chips (/dev/vfio, /dev/accel*)
    else:
        spec["device_requests"] = [{"count": -1, "capabilities": [["gpu"]]}]  # all the host's GPUs
        spec["ipc_mode"] = "host"
    return spec


def docker_client():
    import docker

    host = get_settings().docker_host
    return docker.DockerClient(base_url=host) if host else docker.from_env()


class VllmContainer:
    """A vLLM container through the Docker Engine API: pulled if the host lacks the image, created,
    started, inspected while it runs, its output copied into ``log``, stopped and removed."""

    def __init__(self, spec: dict, *, log: Path) -> None:
        self.spec = spec
        self.path = log
        self.client = None
        self.container = None

    def start(self, on_phase) -> None:
        import docker.errors

        self.client = docker_client()
        image = self.spec["image"]
        try:
            self.client.images.get(image)
        except docker.errors.ImageNotFound:
            on_phase("pulling")
            self.client.images.pull(image)  # "latest" when the image names no tag
        on_phase("loading")
        stale = self.client.containers.list(all=True, filters={"name": self.spec["name"]})
        for old in stale:  # a dead supervisor's container of the same endpoint
            old.remove(force=True)
        self.container = self.client.containers.create(**self.spec)
        self.container.start()

    def exit_reason(self) -> str | None:
        assert self.container is not None, "asked after start()"
        self.container.reload()
        state = self.container.attrs["State"]
        if state["Status"] not in ("exited", "dead"):
            return None
        oom = " (out of memory)" if state.get("OOMKilled") else ""
        return f"the vLLM container exited with code {state['ExitCode']}{oom}: {_last_line(self.log())}"

    def log(self) -> str:
        """The container's latest output, also kept in ``log`` (which outlives the container)."""
        if self.container is not None:
            try:
                text = self.container.logs(tail=LOG_LINES).decode(errors="replace")
            except Exception:  # noqa: BLE001 - removed meanwhile: the file has the last copy
                text = None
            if text is not None:
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(text)
                tmp.replace(self.path)
                return text
        return self.path.read_text(errors="replace") if self.path.exists() else ""

    def phase_of(self, line: str) -> str | None:
        for pattern, phase in VLLM_PHASES:
            if pattern.search(line):
                return phase
        return None

    def stop(self) -> None:
        import docker.errors

        if self.container is None:
            return
        try:
            self.log()  # the last of its output, before the container goes
            self.container.stop(timeout=int(STOP_GRACE_S))
            self.container.remove(force=True)
        except docker.errors.NotFound:
            pass
        self.container = None


def remove_orphans(session, client) -> list[str]:
    """Remove the containers of this Docker Engine that no endpoint runs any more, and return their names:
    those of endpoints deleted, failed or stopped (a supervisor that died, with its host or alone, leaves
    its container running, holding the chips), those of evaluations no longer running, and those of an
    earlier start of an endpoint started again (each start has a key of its own, in its container's
    environment)."""
    import docker.errors

    found = client.containers.list(all=True, filters={"label": ENDPOINT_LABEL}, ignore_removed=True)
    if not found:
        return []
    labels = [c.labels[ENDPOINT_LABEL] for c in found]
    keys = endpoints.live_keys(session, labels)
    # An evaluation serves its subjects as endpoints of its own, named "<evaluation id>-s<n>", with no row
    evaluating = evaluations.running(session, [label.rsplit("-", 1)[0] for label in labels])
    removed = []
    for container in found:
        env = dict(v.split("=", 1) for v in container.attrs["Config"].get("Env") or [] if "=" in v)
        key = keys.get(container.labels[ENDPOINT_LABEL])
        if key is not None and env.get("VLLM_API_KEY") == key:
            continue  # its endpoint's current start: its supervisor runs it
        if container.labels[ENDPOINT_LABEL].rsplit("-", 1)[0] in evaluating:
            continue  # a subject of a running evaluation
        try:
            container.remove(force=True)
        except docker.errors.NotFound:
            continue  # its supervisor removed it meanwhile
        removed.append(container.name)
    return removed
