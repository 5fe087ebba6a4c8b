"""Endpoints: a merged artifact served by a model server on a worker of a pool.

Every change of an endpoint's state is a function here:

    pending --start--> starting --ready--> ready --request_stop--> stopping --stopped--> stopped
       |                   |                 |
       |                   +------fail-------+--> failed       (the model server could not start, or died)
       +--request_stop (no worker yet)--> stopped

The worker side (``worker/endpoints.py``) calls ``start``, ``phase``, ``ready``, ``heartbeat``, ``fail``
and ``stopped``; the API calls ``create``, ``replace``, ``request_stop`` and ``delete``. A worker host that
goes silent leaves its endpoints ``failed`` (``fail_stale``): its model server went with it.

A promotion (``replace``) is a new endpoint serving another artifact under the old one's model name.
The gateway routes a name to its newest ready endpoint, so callers move over when the new one is ready;
the old one is then asked to stop (in ``ready``), and its model server finishes the requests it has
(it stops listening first: a request that finds it gone is sent to the new one).
"""

from __future__ import annotations

import secrets
from datetime import datetime

from sqlalchemy import insert
from sqlmodel import Session, col, func, select

from app.artifacts.models import Artifact, ArtifactKind, ArtifactStatus
from app.auth import service as users
from app.auth.models import User
from app.base_models import service as base_models
from app.core import queue
from app.core.config import get_settings
from app.core.db import claim, owned, owned_page, utcnow
from app.core.echo import echo
from app.core.errors import FieldError
from app.core.security import new_id
from app.endpoints.models import (
    ACTIVE,
    Endpoint,
    EndpointCreate,
    EndpointPublic,
    EndpointSample,
    EndpointSamplePublic,
    EndpointStats,
    EndpointStatus,
    Runtime,
)
from app.endpoints.stats import stats as live_stats
from app.pools.models import ACCELERATORS, GiB, Pool
from app.runs import estimate
from app.runs.models import Run

MAX_ATTEMPTS = 3


class EndpointError(FieldError):
    pass


def cost_usd(session: Session, endpoint: Endpoint) -> float:
    """Chip-hours since it last started (until it stopped) x its pool's price per chip-hour."""
    pool = session.get(Pool, endpoint.pool)
    if pool is None or endpoint.started_at is None:
        return 0.0
    end = endpoint.stopped_at or utcnow()
    return max(0.0, (end - endpoint.started_at).total_seconds()) / 3600 * pool.chips * pool.price_per_chip_hour


def to_public(session: Session, endpoint: Endpoint, viewer: User, stats: EndpointStats | None = None) -> EndpointPublic:
    """The endpoint as ``viewer`` sees it: where its model server listens is for admins only (the others
    call it through the gateway)."""
    update: dict[str, object] = {"cost_usd": round(cost_usd(session, endpoint), 6), "stats": stats}
    if not viewer.is_admin:
        update["url"] = None
    return EndpointPublic.model_validate(endpoint, update=update)


def with_stats(session: Session, endpoints: list[Endpoint], viewer: User) -> list[EndpointPublic]:
    """The endpoints as ``viewer`` sees them, each with its live figures (one query per window for all)."""
    figures = live_stats(session, [e.id for e in endpoints], utcnow())
    return [to_public(session, e, viewer, figures[e.id]) for e in endpoints]


def run_costs(session: Session, run_id: str) -> list[tuple[Endpoint, float]]:
    """Every endpoint that served an artifact of the run, with its cost."""
    query = select(Endpoint).join(Artifact, col(Artifact.id) == Endpoint.artifact_id).where(Artifact.run_id == run_id)
    return [(e, cost_usd(session, e)) for e in session.exec(query.order_by(col(Endpoint.created_at))).all()]


def list_endpoints(
    session: Session, owner: User, *, artifact_id: str | None = None, limit: int = 100, offset: int = 0
) -> list[Endpoint]:
    return owned_page(session, Endpoint, owner, limit=limit, offset=offset, artifact_id=artifact_id)


def get(session: Session, owner: User, endpoint_id: str) -> Endpoint | None:
    return owned(session, Endpoint, owner, endpoint_id)


def runtime_for(pool: Pool) -> Runtime:
    """What serves the pool's endpoints: the built-in server on cpu, vLLM's container on TPU and GPU."""
    if pool.accelerator == "cpu":
        return Runtime.local
    return Runtime.vllm_tpu if pool.accelerator.startswith("tpu") else Runtime.vllm_gpu


def count_live(session: Session, owner_id: int) -> int:
    """The user's endpoints that are live (what ``max_live_endpoints`` limits)."""
    where = (col(Endpoint.owner_id) == owner_id, col(Endpoint.status).in_(ACTIVE))
    return session.exec(select(func.count()).select_from(Endpoint).where(*where)).one()


def _check_limit(session: Session, owner_id: int) -> None:
    users.check_limit(session, owner_id, "max_live_endpoints", lambda: count_live(session, owner_id), "live endpoint")


def _deployable(session: Session, owner: User, artifact_id: str, pool_name: str) -> tuple[Artifact, Pool]:
    artifact = session.get(Artifact, artifact_id)
    if artifact is None or artifact.owner_id != owner.id:
        raise EndpointError("artifact_id", f"unknown artifact {echo(artifact_id)}")
    if artifact.status != ArtifactStatus.succeeded:
        raise EndpointError("artifact_id", f"artifact {artifact.id} is {artifact.status}; only a built one deploys")
    pool = session.get(Pool, pool_name)
    if pool is None:
        raise EndpointError("pool", f"unknown pool {echo(pool_name)}")
    if artifact.kind != ArtifactKind.merged and runtime_for(pool) == Runtime.local:
        raise EndpointError(
            "artifact_id",
            f"artifact {artifact.id} is a PEFT adapter: the built-in model server of pool {pool.name!r} serves "
            "merged models (vLLM on a TPU or GPU pool serves adapters)",
        )
    return artifact, pool


def create(session: Session, owner: User, data: EndpointCreate) -> Endpoint:
    artifact, pool = _deployable(session, owner, data.artifact_id, data.pool)
    _check_parallelism(session, artifact, pool, data.data_parallel_size)
    queue.check_broker()
    assert owner.id is not None, "the owner is a saved user"
    _check_limit(session, owner.id)
    settings = {
        "max_model_len": data.max_model_len,
        "max_num_seqs": data.max_num_seqs,
        "data_parallel_size": data.data_parallel_size,
    }
    return _deploy(session, owner.id, artifact, pool, artifact.name, settings)


def weights_bytes(session: Session, artifact: Artifact) -> int:
    """The bytes of weights a model server of the artifact holds: a merged artifact's safetensors files;
    an adapter's base, at 2 bytes (bfloat16) per parameter of its preset."""
    if artifact.kind == ArtifactKind.merged:
        return sum(int(f.get("size") or 0) for f in artifact.files if str(f.get("path", "")).endswith(".safetensors"))
    run = session.get_one(Run, artifact.run_id)
    return 2 * base_models.resolve(session, run.base_model)[0].arch.params()


def replica_problem(weights: int, pool: Pool, data_parallel_size: int) -> str | None:
    """Why ``data_parallel_size`` replicas of a model of ``weights`` bytes do not fit the pool's chips (each
    replica over chips / data_parallel_size of them by tensor parallelism, as vLLM lays them out), or
    None. A replica's weights must fit the chips' usable memory (the estimate's share: the rest of it
    goes to XLA's own buffers), before any KV cache."""
    if pool.chips % data_parallel_size:
        divisors = [d for d in range(1, pool.chips + 1) if pool.chips % d == 0]
        shown = ", ".join(map(str, divisors))
        return f"pool {pool.name} has {pool.chips} chips: data_parallel_size must divide them ({shown})"
    tp = pool.chips // data_parallel_size
    chip = ACCELERATORS.get(pool.accelerator)
    if chip is None:
        return None
    usable = estimate.USABLE * chip.memory
    if weights / tp <= usable:
        return None
    most = max(
        (d for d in range(1, pool.chips + 1) if pool.chips % d == 0 and weights / (pool.chips // d) <= usable),
        default=0,
    )
    return (
        f"a replica over {tp} {pool.accelerator} chip(s) holds {weights / tp / GiB:.1f} GiB of weights "
        "per chip, "
        f"over the {usable / GiB:.1f} GiB usable of a chip's {chip.memory / GiB:.2f} GiB: "
        + (f"use data_parallel_size {most} or less" if most else f"the model does not fit pool {pool.name}")
    )


def _check_parallelism(session: Session, artifact: Artifact, pool: Pool, data_parallel_size: int) -> None:
    if runtime_for(pool) == Runtime.local:
        if data_parallel_size != 1:
            raise EndpointError(
                "data_parallel_size",
                f"pool {pool.name!r} runs the built-in model server: one replica (data_parallel_size 1)",
            )
        return
    problem = replica_problem(weights_bytes(session, artifact), pool, data_parallel_size)
    if problem is not None:
        raise EndpointError("data_parallel_size", problem)


def _deploy(
    session: Session, owner_id: int, artifact: Artifact, pool: Pool, model: str, settings: dict, **values
) -> Endpoint:
    endpoint = Endpoint(
        id=new_id("ep"),
        owner_id=owner_id,
        artifact_id=artifact.id,
        model=model,
        pool=pool.name,
        runtime=runtime_for(pool),
        settings=settings,
        **values,
    )
    session.add(endpoint)
    session.commit()
    queue.send_task(queue.START_ENDPOINT, endpoint.id, queue=pool.name)
    return endpoint


def replace(session: Session, owner: User, old: Endpoint, artifact_id: str) -> Endpoint:
    """Promote an artifact into a ready endpoint's place: a new endpoint on the same pool, with the same
    settings, serving it under the old one's model name; once it is ready, the old one stops (``ready``).
    Not counted against ``max_live_endpoints``: the two are live together only until then."""
    if old.status != EndpointStatus.ready:
        raise EndpointError(
            "status", f"endpoint {old.id} is {old.status}; only a ready endpoint's model is replaced", conflict=True
        )
    artifact, pool = _deployable(session, owner, artifact_id, old.pool)
    under_way = session.exec(
        select(Endpoint.id).where(Endpoint.replaces_id == old.id, col(Endpoint.status).in_(ACTIVE))
    ).first()
    if under_way is not None:
        raise EndpointError("status", f"endpoint {under_way} is already replacing endpoint {old.id}", conflict=True)
    queue.check_broker()
    return _deploy(session, old.owner_id, artifact, pool, old.model, dict(old.settings), replaces_id=old.id)


def serving(session: Session, owner: User, model: str) -> Endpoint | None:
    """The user's ready endpoint serving ``model`` (the newest, if several)."""
    query = select(Endpoint).where(
        Endpoint.owner_id == owner.id, Endpoint.model == model, Endpoint.status == EndpointStatus.ready
    )
    return session.exec(query.order_by(col(Endpoint.ready_at).desc())).first()


def ready_endpoints(session: Session, owner: User) -> list[Endpoint]:
    query = select(Endpoint).where(Endpoint.owner_id == owner.id, Endpoint.status == EndpointStatus.ready)
    return list(session.exec(query.order_by(Endpoint.model)).all())


def record_sample(session: Session, endpoint_id: str, source: str, **values) -> None:
    session.add(EndpointSample(endpoint_id=endpoint_id, source=source, **values))
    session.commit()


def record_samples(session: Session, rows: list[dict]) -> None:
    """Many samples in one insert (each row: every column but ``id``)."""
    session.execute(insert(EndpointSample), rows)
    session.commit()


def samples(session: Session, endpoint: Endpoint, *, since: datetime) -> list[EndpointSamplePublic]:
    rows = session.exec(
        select(EndpointSample)
        .where(EndpointSample.endpoint_id == endpoint.id, EndpointSample.at >= since)
        .order_by(col(EndpointSample.at))
    ).all()
    out = []
    for r in rows:
        decoding = r.duration_s - (r.ttft_s or 0.0)
        streamed = r.ttft_s is not None and r.output_tokens > 1 and decoding > 0
        rate = (r.output_tokens - 1) / decoding if streamed else None
        out.append(EndpointSamplePublic(**r.model_dump(exclude={"id", "endpoint_id"}), tokens_per_s=rate))
    return out


def request_stop(session: Session, endpoint: Endpoint) -> Endpoint:
    """Stop: its worker stops the model server (``stopping``, then ``stopped``); one not started yet
    stops at once."""
    if endpoint.status == EndpointStatus.pending:
        _set(session, endpoint, EndpointStatus.stopped, stopped_at=utcnow())
    elif endpoint.status in (EndpointStatus.starting, EndpointStatus.ready):
        _set(session, endpoint, EndpointStatus.stopping)
    return endpoint


def restart(session: Session, endpoint: Endpoint) -> Endpoint:
    """Start a failed or stopped endpoint again, on its pool, as it was deployed."""
    if endpoint.status in ACTIVE:
        raise EndpointError("status", f"endpoint {endpoint.id} is {endpoint.status}; stop it first", conflict=True)
    artifact = session.get(Artifact, endpoint.artifact_id)
    if artifact is None or artifact.status != ArtifactStatus.succeeded:
        raise EndpointError("artifact_id", f"artifact {endpoint.artifact_id} is gone", conflict=True)
    queue.check_broker()
    _check_limit(session, endpoint.owner_id)
    _set(
        session,
        endpoint,
        EndpointStatus.pending,
        phase=None,
        url=None,
        api_key=None,
        error=None,
        worker=None,
        pid=None,
        attempts=0,
        started_at=None,
        ready_at=None,
        stopped_at=None,
    )
    queue.send_task(queue.START_ENDPOINT, endpoint.id, queue=endpoint.pool)
    return endpoint


def live_keys(session: Session, endpoint_ids: list[str]) -> dict[str, str]:
    """The key of the current start of each of these endpoints that is live (pending ones have none yet):
    a model server started with another key, or for an endpoint not listed here, is no one's."""
    query = select(Endpoint.id, Endpoint.api_key).where(
        col(Endpoint.id).in_(endpoint_ids), col(Endpoint.status).in_(ACTIVE)
    )
    rows = session.exec(query).all()
    return {id_: key for id_, key in rows if key}


def waiting_tasks(session: Session) -> list[queue.Waiting]:
    """Endpoints that wait for a worker of their pool to start them."""
    rows = session.exec(
        select(Endpoint.id, Endpoint.pool, Endpoint.updated_at).where(Endpoint.status == EndpointStatus.pending)
    ).all()
    return [queue.Waiting(queue.START_ENDPOINT, pool, id_, since) for id_, pool, since in rows]


def delete(session: Session, endpoint: Endpoint) -> None:
    if endpoint.status in ACTIVE:
        raise EndpointError("status", f"endpoint {endpoint.id} is {endpoint.status}; stop it first", conflict=True)
    session.delete(endpoint)
    session.commit()


def _set(session: Session, endpoint: Endpoint, status: EndpointStatus, **values) -> None:
    endpoint.status = status
    for k, v in values.items():
        setattr(endpoint, k, v)
    endpoint.updated_at = utcnow()
    session.add(endpoint)
    session.commit()


# --- worker side --------------------------------------------------------------------------------


def wait_for_chips(session: Session, endpoint_id: str, why: str, retry_s: float) -> None:
    """The host that got the endpoint's task has its chips taken (``why`` says by what): the endpoint says
    so while it stays pending, and its task is sent again in ``retry_s``, to this host or another."""
    endpoint = session.get(Endpoint, endpoint_id)
    if endpoint is None or endpoint.status != EndpointStatus.pending:
        return
    endpoint.phase, endpoint.waiting = "waiting for chips", why
    endpoint.updated_at = utcnow()  # it is not lost: `resend_lost` counts from here
    session.add(endpoint)
    session.commit()
    queue.send_task(queue.START_ENDPOINT, endpoint.id, queue=endpoint.pool, countdown=retry_s)


def start(session: Session, endpoint_id: str, worker: str, pid: int) -> Endpoint | None:
    """A worker's supervisor takes the endpoint (``claim``); None when it is not pending any more."""
    endpoint = session.get(Endpoint, endpoint_id)
    if endpoint is None or endpoint.status != EndpointStatus.pending:
        return None
    if endpoint.attempts >= MAX_ATTEMPTS:
        fail(session, endpoint, f"gave up after {endpoint.attempts} attempts")
        return None
    now = utcnow()
    if not claim(
        session,
        endpoint,
        status=EndpointStatus.starting,
        phase="loading",
        waiting=None,
        api_key=secrets.token_urlsafe(32),  # its model server's key, new at each start
        worker=worker,
        pid=pid,
        heartbeat_at=now,
        started_at=now,
        updated_at=now,
    ):
        return None
    return endpoint


def phase(session: Session, endpoint: Endpoint, name: str, url: str | None = None) -> None:
    session.refresh(endpoint)
    if endpoint.status == EndpointStatus.starting:
        _set(session, endpoint, EndpointStatus.starting, phase=name, url=url or endpoint.url)


def ready(session: Session, endpoint: Endpoint, url: str) -> None:
    """Ready: the gateway sends its model's requests here from now on, so the endpoint it replaces (if
    any) is asked to stop."""
    session.refresh(endpoint)
    if endpoint.status == EndpointStatus.starting:
        _set(session, endpoint, EndpointStatus.ready, phase=None, url=url, ready_at=utcnow())
        old = session.get(Endpoint, endpoint.replaces_id) if endpoint.replaces_id else None
        if old is not None:
            request_stop(session, old)


def heartbeat(session: Session, endpoint: Endpoint, log_tail: str | None = None) -> EndpointStatus:
    """Record liveness, and the model server's latest output when given; returns the status
    (``stopping`` tells the supervisor to stop)."""
    session.refresh(endpoint)
    endpoint.heartbeat_at = utcnow()
    if log_tail is not None:
        endpoint.log_tail = log_tail
    session.add(endpoint)
    session.commit()
    return EndpointStatus(endpoint.status)


def fail(session: Session, endpoint: Endpoint, error: str, log_tail: str | None = None) -> None:
    """Failed, with the model server's last output when given (so the page shows the lines that led
    to it as soon as it shows the failure)."""
    session.refresh(endpoint)
    if endpoint.status in ACTIVE:
        if log_tail is not None:
            endpoint.log_tail = log_tail
        _set(session, endpoint, EndpointStatus.failed, phase=None, error=error[:2000], stopped_at=utcnow())


def stopped(session: Session, endpoint: Endpoint, log_tail: str | None = None) -> None:
    """Stopped, with the model server's last output when given (a lost host's endpoint keeps the
    last it sent)."""
    session.refresh(endpoint)
    if log_tail is not None:
        endpoint.log_tail = log_tail
    _set(session, endpoint, EndpointStatus.stopped, phase=None, stopped_at=utcnow())


def fail_stale(session: Session, pool: str) -> list[str]:
    """Endpoints of this pool whose supervisor went silent: their host was lost, and its model server
    with it. A stop requested meanwhile completes; anything else fails."""
    cutoff = utcnow() - get_settings().stale_after
    stale = session.exec(
        select(Endpoint).where(
            Endpoint.pool == pool,
            col(Endpoint.status).in_([EndpointStatus.starting, EndpointStatus.ready, EndpointStatus.stopping]),
            col(Endpoint.heartbeat_at) < cutoff,
        )
    ).all()
    for endpoint in stale:
        if endpoint.status == EndpointStatus.stopping:
            stopped(session, endpoint)
        else:
            fail(session, endpoint, f"no heartbeat from {endpoint.worker} for {get_settings().stale_seconds:.0f}s")
    return [e.id for e in stale]
