"""Settings, read once from the environment (TUNEDECK_*)."""

import secrets
from datetime import timedelta
from functools import cached_property, lru_cache
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MIN_ADMIN_TOKEN = 32


def _own_address() -> str:
    """This host's address as its name resolves (on a Cloud TPU VM: its internal address)."""
    import socket

    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TUNEDECK_", extra="ignore")

    data_dir: Path = Path("data")
    database_url: str | None = None
    broker_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    admin_username: str = "admin"
    admin_password: str | None = None
    admin_token: str | None = Field(
        default=None, description="an admin API token with this value exists (at least 32 characters)"
    )
    secret_key: str | None = None
    pool: str = "cpu"
    slice: str | None = Field(default=None, description="a worker of a slice pool: its slice (tunedeck worker --slice)")
    host_index: int | None = Field(default=None, ge=0, description="its place in the slice (--host-index)")
    host_address: str = Field(
        default_factory=lambda: _own_address(),
        description="the address the other hosts of this worker's slice reach it at (host 0 coordinates a run)",
    )
    accelerator_jobs: int | None = Field(
        default=None,
        ge=0,
        description="accelerator jobs (runs, merge verifications, model servers) at a time on this worker's "
        "host; default 1 on an accelerator pool, no limit on a cpu pool; 0: no limit",
    )
    slice_join_seconds: float = Field(
        default=300.0, gt=0, description="how long a slice's hosts wait for each other when a run starts"
    )
    tpu_metadata_url: str = Field(
        default="http://metadata.google.internal",
        description="a Cloud TPU VM's metadata server, where a slice pool's worker reads its slice and index",
    )
    max_upload_bytes: int = Field(default=10 * 1024**3, gt=0)
    max_body_bytes: int = Field(
        default=1024**2, gt=0, description="the largest request body of the API and the pages (uploads aside)"
    )
    gateway_max_body_bytes: int = Field(
        default=32 * 1024**2, gt=0, description="the largest request body of the gateway's OpenAI routes"
    )
    worker_heartbeat_seconds: float = Field(default=5.0, gt=0)
    training_standby: bool = Field(
        default=True,
        description="each worker process keeps a training process started ahead, its imports done (about "
        "0.5 GB of memory while it waits): a run starts training seconds sooner",
    )
    stale_seconds: float = Field(
        default=30.0,
        gt=0,
        description="a running run or artifact build whose worker is silent this long is re-queued "
        "(a benchmark or an endpoint: failed)",
    )
    lost_task_seconds: float = Field(
        default=60.0,
        gt=0,
        description="a row waiting this long for a task its queue does not hold has the task sent again",
    )
    max_live_endpoints: int = Field(
        default=10,
        ge=0,
        description="a user's live endpoints (pending, starting, ready, stopping) at most, unless an admin "
        "set the user's own limit",
    )
    max_active_runs: int = Field(
        default=20,
        ge=0,
        description="a user's active runs (validating files, queued, running, paused) at most, unless an "
        "admin set the user's own limit",
    )
    cookie_secure: bool = False
    login_window_seconds: float = Field(
        default=60.0, gt=0, le=86400, description="the window in which failed logins are counted"
    )
    login_failures_per_account: int = Field(
        default=5, ge=1, description="failed logins of one username in the window before it must wait (429)"
    )
    login_failures_per_address: int = Field(
        default=20, ge=1, description="failed logins from one client address in the window before it must wait (429)"
    )
    password_checks: int = Field(
        default=2,
        ge=1,
        description="argon2 password checks at once per web process (64 MiB and a core each); more wait their turn",
    )
    web_workers: int = Field(default=1, ge=1, description="web processes (uvicorn workers)")
    web_threads: int = Field(default=8, ge=1, description="threads per web process for sync endpoints")
    probe_seconds: float = Field(
        default=15.0, gt=0, description="how often each ready endpoint is probed and its /metrics scraped"
    )
    gateway_route_seconds: float = Field(
        default=2.0,
        ge=0,
        description="how long the gateway remembers which endpoint serves a model "
        "(one that stops answering is looked up again at once)",
    )
    serve_host: str = Field(
        default="127.0.0.1",
        description="the address model servers of this worker bind and are reached at (by the web process)",
    )
    docker_host: str | None = Field(
        default=None,
        description="the Docker Engine that runs vLLM containers on TPU and GPU pools "
        "(unix:///var/run/docker.sock, tcp://host:2375); unset: DOCKER_HOST or the local socket",
    )
    vllm_tpu_image: str = Field(default="vllm/vllm-tpu:latest", description="the vLLM image of TPU pools")
    vllm_gpu_image: str = Field(default="vllm/vllm-openai:latest", description="the vLLM image of GPU pools")
    vllm_shm_size: str = Field(default="16g", description="the shared memory of a vLLM container")
    hf_token: SecretStr | None = Field(default=None, description="HF_TOKEN handed to vLLM containers")
    web_url: str | None = Field(
        default=None,
        description="the web app's address as workers reach it: a worker on another host copies an "
        "artifact from it when there is no artifact store (default http://HOST:PORT)",
    )
    artifact_cache_gb: float = Field(
        default=200.0,
        gt=0,
        description="the artifacts a worker keeps copies of (built on other hosts) at most, in GB: the least "
        "recently used that no live endpoint serves are removed past it",
    )
    artifact_store: str = Field(
        default="",
        description="where finished artifacts are kept: an fsspec URL prefix (gs://bucket/prefix); "
        "empty: <data dir>/artifacts",
    )

    @field_validator("admin_token")
    @classmethod
    def _long_enough(cls, v: str | None) -> str | None:
        if not v:
            return None
        if len(v) < MIN_ADMIN_TOKEN:
            raise ValueError(
                f"TUNEDECK_ADMIN_TOKEN must be at least {MIN_ADMIN_TOKEN} characters (it has {len(v)}); make one with: "
                "python -c 'import secrets; print(\"td_\" + secrets.token_urlsafe(32))'"
            )
        return v

    @field_validator("data_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @cached_property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'tunedeck.db'}"

    @cached_property
    def celery_broker_url(self) -> str:
        """The configured broker, or a SQLite-file broker that needs no server."""
        return self.broker_url or f"sqla+sqlite:///{self.data_dir / 'broker.db'}"

    @property
    def stale_after(self) -> timedelta:
        return timedelta(seconds=self.stale_seconds)

    @property
    def lost_task_after(self) -> timedelta:
        return timedelta(seconds=self.lost_task_seconds)

    @property
    def storage_dir(self) -> Path:
        return self.data_dir / "storage"

    @property
    def public_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def web_base_url(self) -> str:
        """Where workers reach the web app (TUNEDECK_WEB_URL, else this host's listening address)."""
        if self.web_url:
            return self.web_url.rstrip("/")
        return f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '::') else self.host}:{self.port}"

    def session_secret(self) -> str:
        """The cookie-signing key: TUNEDECK_SECRET_KEY, else one made once and kept in the data dir."""
        if self.secret_key:
            return self.secret_key
        path = self.data_dir / "secret_key"
        if not path.exists():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(secrets.token_urlsafe(48))
            tmp.chmod(0o600)
            tmp.replace(path)
        return path.read_text().strip()


@lru_cache
def get_settings() -> Settings:
    return Settings()
