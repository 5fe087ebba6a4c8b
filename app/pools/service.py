"""Pools of like hosts, and the heartbeats of the workers serving them."""

from datetime import timedelta

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from app.core.config import get_settings
from app.core.db import utcnow
from app.core.echo import echo
from app.pools.models import (
    ACCELERATORS,
    Pool,
    PoolCreate,
    PoolPublic,
    PoolUpdate,
    SlicePublic,
    WorkerHost,
    WorkerPublic,
)

# The embedded pool (this machine) and the two TPU pools of the published Gemma 4 recipe:
# train on a v5p-8 (4 chips), serve on a v6e-8 (8 chips); and the multi-host v5p slices, 4 chips a host
# (v5p-16: 2 hosts, v5p-32: 4), whose runs train on every host of a slice. Prices: on-demand USD per
# chip-hour.
SEED_POOLS = (
    PoolCreate(name="cpu", accelerator="cpu", chips=1, price_per_chip_hour=0.0, description="This machine's CPU"),
    PoolCreate(
        name="tpu-v5p-8",
        accelerator="tpu-v5p-8",
        chips=4,
        price_per_chip_hour=4.20,
        description="TPU v5p-8 host: LoRA training of Gemma 4 31B",
    ),
    PoolCreate(
        name="tpu-v6e-8",
        accelerator="tpu-v6e-8",
        chips=8,
        price_per_chip_hour=2.70,
        description="TPU v6e-8 host: vLLM-TPU serving",
    ),
    PoolCreate(
        name="tpu-v5p-16",
        accelerator="tpu-v5p-16",
        chips=8,
        hosts_per_slice=2,
        price_per_chip_hour=4.20,
        description="TPU v5p-16 slice: 2 hosts of 4 chips, one run across both",
    ),
    PoolCreate(
        name="tpu-v5p-32",
        accelerator="tpu-v5p-32",
        chips=16,
        hosts_per_slice=4,
        price_per_chip_hour=4.20,
        description="TPU v5p-32 slice: 4 hosts of 4 chips, one run across all",
    ),
)


class PoolError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def seed(session: Session) -> None:
    for pool in SEED_POOLS:
        if session.get(Pool, pool.name) is None:
            session.add(Pool.model_validate(pool))
    session.commit()


def _check_accelerator(accelerator: str | None) -> None:
    if accelerator is not None and accelerator not in ACCELERATORS:
        raise PoolError(
            "accelerator", f"unknown accelerator {echo(accelerator)}; expected one of {', '.join(ACCELERATORS)}"
        )


def online_cutoff():
    return utcnow() - timedelta(seconds=3 * get_settings().worker_heartbeat_seconds)


def workers(session: Session, pool: str | None = None) -> list[WorkerPublic]:
    query = select(WorkerHost).where(col(WorkerHost.stopped_at).is_(None)).order_by(WorkerHost.hostname)
    if pool is not None:
        query = query.where(WorkerHost.pool == pool)
    cutoff = online_cutoff()
    return [WorkerPublic(**w.model_dump(), online=w.last_seen >= cutoff) for w in session.exec(query)]


def to_public(pool: Pool, pool_workers: list[WorkerPublic]) -> PoolPublic:
    by_slice: dict[str, list[WorkerPublic]] = {}
    for w in pool_workers:
        if w.slice is not None:
            by_slice.setdefault(w.slice, []).append(w)
    slices = [
        SlicePublic(
            name=name,
            hosts=sorted(hosts, key=lambda w: w.host_index or 0),
            complete={w.host_index for w in hosts if w.online} == set(range(pool.hosts_per_slice)),
        )
        for name, hosts in sorted(by_slice.items())
    ]
    return PoolPublic(
        **pool.model_dump(),
        chips_per_host=pool.chips // pool.hosts_per_slice,
        workers=pool_workers,
        workers_online=sum(w.online for w in pool_workers),
        slices=slices,
    )


def list_pools(session: Session) -> list[PoolPublic]:
    by_pool: dict[str, list[WorkerPublic]] = {}
    for w in workers(session):
        by_pool.setdefault(w.pool, []).append(w)
    return [to_public(p, by_pool.get(p.name, [])) for p in session.exec(select(Pool).order_by(Pool.name))]


def get_pool(session: Session, name: str) -> PoolPublic | None:
    pool = session.get(Pool, name)
    return None if pool is None else to_public(pool, workers(session, name))


def create_pool(session: Session, data: PoolCreate) -> Pool:
    _check_accelerator(data.accelerator)
    if session.get(Pool, data.name) is not None:
        raise PoolError("name", f"a pool named {echo(data.name)} exists")
    pool = Pool.model_validate(data)
    session.add(pool)
    session.commit()
    session.refresh(pool)
    return pool


def update_pool(session: Session, pool: Pool, data: PoolUpdate) -> Pool:
    changes = data.model_dump(exclude_unset=True)
    _check_accelerator(changes.get("accelerator"))
    if (chips := changes.get("chips", pool.chips)) % pool.hosts_per_slice:
        raise PoolError("chips", f"{chips} chips do not split evenly over {pool.hosts_per_slice} hosts")
    pool.sqlmodel_update(changes)
    session.add(pool)
    session.commit()
    session.refresh(pool)
    return pool


class PoolInUse(Exception):
    pass


def delete_pool(session: Session, pool: Pool) -> None:
    try:
        session.delete(pool)
        session.commit()
    except IntegrityError as exc:
        session.rollback()
        raise PoolInUse(f"pool {pool.name} has runs; it cannot be deleted") from exc


def heartbeat(session: Session, hostname: str, pool: str, pid: int, slice_: tuple[str, int] | None = None) -> None:
    """A worker is alive (``slice_``: the slice of a multi-host pool it is a host of, and its index there)."""
    host = session.get(WorkerHost, hostname)
    now = utcnow()
    if host is None or host.pid != pid or host.stopped_at is not None:
        host = host or WorkerHost(hostname=hostname, pool=pool, pid=pid)
        host.pool, host.pid, host.started_at, host.stopped_at = pool, pid, now, None
        host.slice, host.host_index = slice_ if slice_ else (None, None)
    host.last_seen = now
    session.add(host)
    session.commit()


def worker_stopped(session: Session, hostname: str) -> None:
    host = session.get(WorkerHost, hostname)
    if host is not None:
        host.stopped_at = utcnow()
        session.add(host)
        session.commit()


def workers_online(session: Session) -> dict[str, int]:
    counts: dict[str, int] = {}
    for w in workers(session):
        if w.online:
            counts[w.pool] = counts.get(w.pool, 0) + 1
    return counts
