from dataclasses import dataclass
from datetime import datetime

from pydantic import ValidationInfo, field_validator
from sqlmodel import Field, SQLModel

from app.core.db import utcnow
from app.core.schemas import NAME_LENGTH, Schema

MAX_PRICE = 100_000.0  # USD per chip-hour, far above any real price
GB, GiB = 10**9, 1024**3


@dataclass(frozen=True)
class Chip:
    memory: float  # bytes
    peak_flops: float  # bf16 FLOP/s


# What a pool's accelerator is, per chip (published figures). Google quotes TPU HBM in GB (10^9 bytes):
# v5p 95 GB, v5e 16 GB; a v6e chip ("32 GB") shows 31.25 GiB to JAX.
ACCELERATORS = {
    "cpu": Chip(16 * GiB, 1e11),
    "tpu-v5p-8": Chip(95 * GB, 459e12),
    "tpu-v5p-16": Chip(95 * GB, 459e12),
    "tpu-v5p-32": Chip(95 * GB, 459e12),
    "tpu-v6e-8": Chip(31.25 * GiB, 918e12),
    "tpu-v5e-8": Chip(16 * GB, 197e12),
    "gpu-h100x1": Chip(80 * GiB, 989e12),
    "gpu-h100x2": Chip(80 * GiB, 989e12),
    "gpu-h100x8": Chip(80 * GiB, 989e12),
    "gpu-h200x1": Chip(141 * GiB, 989e12),
}
MAX_HOSTS_PER_SLICE = 256


def _absolute_dir(path: str | None) -> str | None:
    if path is not None and not path.startswith("/"):
        raise ValueError("must be an absolute path, mounted at the same place on every host of the pool")
    return path


class PoolBase(Schema):
    accelerator: str = Field(max_length=32, description=f"one of {', '.join(ACCELERATORS)}")
    chips: int = Field(ge=1, le=4096, description="the chips a job gets: on a multi-host slice, all of its hosts'")
    hosts_per_slice: int = Field(
        default=1,
        ge=1,
        le=MAX_HOSTS_PER_SLICE,
        description="hosts that make one slice (a TPU v5p-16 slice: 2 hosts of 4 chips), whose jobs run on all of them",
    )
    price_per_chip_hour: float = Field(ge=0, le=MAX_PRICE, description="USD per chip-hour")
    description: str = Field(default="", max_length=500)
    shared_dir: str | None = Field(
        default=None,
        max_length=1024,
        description="a directory every host of a slice mounts at this same absolute path: its runs' checkpoints",
    )

    @field_validator("shared_dir")
    @classmethod
    def _absolute(cls, path: str | None) -> str | None:
        return _absolute_dir(path)


class PoolCreate(PoolBase):
    name: str = Field(min_length=1, max_length=NAME_LENGTH, schema_extra={"pattern": r"^[a-z0-9][a-z0-9-]*$"})

    @field_validator("hosts_per_slice")
    @classmethod
    def _chips_per_host(cls, hosts: int, info: ValidationInfo) -> int:
        chips = info.data.get("chips")
        if chips is not None and chips % hosts:
            raise ValueError(f"{chips} chips do not split evenly over {hosts} hosts")
        return hosts


class PoolUpdate(Schema):
    """The fields to change; one left out keeps its value (each must have one: null is refused)."""

    accelerator: str | None = Field(default=None, max_length=32)
    chips: int | None = Field(default=None, ge=1, le=4096)
    price_per_chip_hour: float | None = Field(default=None, ge=0, le=MAX_PRICE)
    description: str | None = Field(default=None, max_length=500)
    shared_dir: str | None = Field(default=None, max_length=1024)

    @field_validator("shared_dir")
    @classmethod
    def _absolute(cls, path: str | None) -> str | None:
        return _absolute_dir(path)

    @field_validator("*", mode="before")
    @classmethod
    def _not_null(cls, value):
        if value is None:
            raise ValueError("must have a value: leave the field out to keep it")
        return value


class Pool(PoolBase, table=True):
    __tablename__ = "pools"  # pyright: ignore[reportAssignmentType]
    name: str = Field(primary_key=True, max_length=64)
    created_at: datetime = Field(default_factory=utcnow)


class WorkerHost(SQLModel, table=True):
    """A worker process serving a pool; it writes `last_seen` every few seconds while alive."""

    __tablename__ = "worker_hosts"  # pyright: ignore[reportAssignmentType]
    hostname: str = Field(primary_key=True, max_length=255)
    pool: str = Field(max_length=64, index=True)
    slice: str | None = Field(default=None, max_length=128)  # of a multi-host slice pool: its slice
    host_index: int | None = None  # and its place in it (0: the slice's coordinator)
    pid: int
    started_at: datetime = Field(default_factory=utcnow)
    last_seen: datetime = Field(default_factory=utcnow, index=True)
    stopped_at: datetime | None = None


class WorkerPublic(SQLModel):
    hostname: str
    pool: str
    slice: str | None
    host_index: int | None
    pid: int
    started_at: datetime
    last_seen: datetime
    online: bool


class SlicePublic(SQLModel):
    """A slice of a multi-host pool as its workers report it: its hosts by index."""

    name: str
    hosts: list[WorkerPublic]
    complete: bool  # every host of the slice is online


class PoolPublic(PoolCreate):
    created_at: datetime
    chips_per_host: int
    workers_online: int
    workers: list[WorkerPublic]
    slices: list[SlicePublic]


class PoolsPublic(SQLModel):
    data: list[PoolPublic]
    count: int
