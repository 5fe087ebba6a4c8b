"""Artifacts: what a run leaves to deploy or download: its LoRA merged into the base (an HF
checkpoint) or exported as a PEFT adapter. The only place an artifact's state changes.

A run that succeeds gets its merged artifact at once (named by the run's ``fine_tuned_model``);
any checkpoint can be merged or exported on demand. The work is a task on the run's pool queue
(`worker/artifacts.py`), which reports progress in bytes and a verification of the merged weights
against the LoRA model; a merge that fails verification is `failed`, never offered for deploy.
"""

from __future__ import annotations

import posixpath
import shutil
from pathlib import Path

import fsspec
from sqlalchemy import update
from sqlmodel import Session, col, select

from app.artifacts.models import (
    ACTIVE,
    Artifact,
    ArtifactCreate,
    ArtifactKind,
    ArtifactPublic,
    ArtifactStatus,
)
from app.auth.models import User
from app.core import queue
from app.core.config import get_settings
from app.core.db import claim, owned, owned_page, utcnow
from app.core.echo import echo
from app.core.errors import FieldError
from app.core.security import new_id
from app.endpoints.models import ACTIVE as ENDPOINT_ACTIVE
from app.endpoints.models import Endpoint
from app.runs.models import Run, RunCheckpoint, RunStatus

MAX_ATTEMPTS = 3


class ArtifactError(FieldError):
    pass


def build_dir(artifact_id: str) -> Path:
    """Where a worker writes the artifact (a local disk: the merge streams into files it renames)."""
    return get_settings().data_dir / "artifacts" / artifact_id


def store_url(artifact_id: str) -> str | None:
    """Where a finished artifact is kept when an artifact store is configured (``gs://...``)."""
    store = get_settings().artifact_store.rstrip("/")
    return f"{store}/{artifact_id}" if store else None


def served(session: Session) -> set[str]:
    """The artifacts that live endpoints serve (a host's copies of them are kept)."""
    query = select(Endpoint.artifact_id).where(col(Endpoint.status).in_(ENDPOINT_ACTIVE))
    return set(session.exec(query).all())


def _fs(path: str):
    return fsspec.core.url_to_fs(path)


def to_public(artifact: Artifact) -> ArtifactPublic:
    return ArtifactPublic(
        **artifact.model_dump(exclude={"owner_id", "worker", "heartbeat_at", "updated_at"}),
        size_bytes=sum(f["size"] for f in artifact.files),
    )


def list_artifacts(
    session: Session, owner: User, *, run_id: str | None = None, limit: int = 100, offset: int = 0
) -> list[Artifact]:
    return owned_page(session, Artifact, owner, limit=limit, offset=offset, run_id=run_id)


def get(session: Session, owner: User, artifact_id: str) -> Artifact | None:
    return owned(session, Artifact, owner, artifact_id)


def by_name(session: Session, name: str) -> Artifact | None:
    """The succeeded merged artifact a model id names (a run's ``fine_tuned_model``)."""
    query = select(Artifact).where(
        Artifact.name == name, Artifact.kind == ArtifactKind.merged, Artifact.status == ArtifactStatus.succeeded
    )
    return session.exec(query.order_by(col(Artifact.created_at).desc())).first()


def _name(run: Run, kind: ArtifactKind, step: int, final: bool) -> str:
    from app.runs.service import fine_tuned_model_name

    name = fine_tuned_model_name(run) if final else f"{fine_tuned_model_name(run)}:step-{step}"
    return name if kind == ArtifactKind.merged else f"{name}:adapter"


def create(session: Session, owner: User, data: ArtifactCreate) -> Artifact:
    run = session.get(Run, data.run_id)
    if run is None or run.owner_id != owner.id:
        raise ArtifactError("run_id", f"unknown run {echo(data.run_id)}")
    steps = sorted(session.exec(select(RunCheckpoint.step).where(RunCheckpoint.run_id == run.id)).all())
    if not steps:
        raise ArtifactError("checkpoint_step", f"run {run.id} has no checkpoint yet")
    step = data.checkpoint_step if data.checkpoint_step is not None else steps[-1]
    if step not in steps:
        raise ArtifactError("checkpoint_step", f"run {run.id} has no checkpoint at step {step}; it has {steps}")
    same = session.exec(
        select(Artifact).where(
            Artifact.run_id == run.id,
            Artifact.kind == data.kind,
            Artifact.checkpoint_step == step,
            Artifact.status != ArtifactStatus.failed,
        )
    ).first()
    if same is not None:
        raise ArtifactError("checkpoint_step", f"artifact {same.id} is this {data.kind} of step {step}", conflict=True)
    final = run.status == RunStatus.succeeded and step == steps[-1]
    queue.check_broker()
    return _enqueue(session, run, data.kind, step, _name(run, data.kind, step, final))


def waiting_tasks(session: Session) -> list[queue.Waiting]:
    """Builds on no worker that wait for one: queued, or re-queued after their worker was lost."""
    rows = session.exec(
        select(Artifact.id, Run.pool, Artifact.updated_at, Artifact.heartbeat_at)
        .join(Run, col(Run.id) == col(Artifact.run_id))
        .where(col(Artifact.status).in_(ACTIVE), col(Artifact.worker).is_(None))
    ).all()
    return [queue.Waiting(queue.BUILD_ARTIFACT, pool, id_, max(at, beat or at)) for id_, pool, at, beat in rows]


def _enqueue(session: Session, run: Run, kind: ArtifactKind, step: int, name: str) -> Artifact:
    artifact = _new(session, run, kind, step, name)
    queue.send_task(queue.BUILD_ARTIFACT, artifact.id, queue=run.pool)
    return artifact


def _new(session: Session, run: Run, kind: ArtifactKind, step: int, name: str) -> Artifact:
    artifact = Artifact(
        id=new_id("art"), owner_id=run.owner_id, run_id=run.id, kind=kind, checkpoint_step=step, name=name
    )
    artifact.path = store_url(artifact.id) or str(build_dir(artifact.id))
    session.add(artifact)
    session.commit()
    return artifact


def new_merge(session: Session, run: Run, step: int) -> Artifact:
    """A merged artifact of the run's checkpoint at ``step``, queued, with no task sent: the caller (an
    evaluation's worker) builds it itself. Were that worker lost, ``waiting_tasks`` has it sent."""
    steps = session.exec(select(RunCheckpoint.step).where(RunCheckpoint.run_id == run.id)).all()
    final = run.status == RunStatus.succeeded and step == max(steps, default=None)
    return _new(session, run, ArtifactKind.merged, step, _name(run, ArtifactKind.merged, step, final))


def on_run_succeeded(session: Session, run: Run) -> Artifact | None:
    """A run that succeeded gets its merged artifact, from its last checkpoint."""
    step = session.exec(
        select(RunCheckpoint.step).where(RunCheckpoint.run_id == run.id).order_by(col(RunCheckpoint.step).desc())
    ).first()
    if step is None:
        return None
    assert run.fine_tuned_model is not None, "runs.finish names the model before it calls this"
    return _enqueue(session, run, ArtifactKind.merged, step, run.fine_tuned_model)


def wait_for_chips(session: Session, artifact_id: str, why: str, retry_s: float) -> None:
    """The host that got the build's task has its chips taken (``why`` says by what; a merge's verification
    needs them): the artifact says so while it stays queued, and its task is sent again in ``retry_s``."""
    artifact = session.get(Artifact, artifact_id)
    if artifact is None or artifact.status != ArtifactStatus.queued:
        return
    run = session.get_one(Run, artifact.run_id)
    artifact.waiting, artifact.updated_at = why, utcnow()  # it is not lost: `resend_lost` counts from here
    session.add(artifact)
    session.commit()
    queue.send_task(queue.BUILD_ARTIFACT, artifact.id, queue=run.pool, countdown=retry_s)


def start(session: Session, artifact_id: str, worker: str) -> Artifact | None:
    """A worker takes the artifact (``claim``: a compare-and-set on ``attempts``); None when there is
    nothing to do, or a live worker is on it. A re-queued build (its worker went silent) starts over:
    the output appears only when whole."""
    artifact = session.get(Artifact, artifact_id)
    if artifact is None or artifact.status not in ACTIVE:
        return None
    beat = artifact.heartbeat_at
    beating = artifact.worker and beat is not None and utcnow() - beat < get_settings().stale_after
    if artifact.status == ArtifactStatus.running and beating:
        return None  # another worker is on it (a re-queued build has no worker)
    if artifact.attempts >= MAX_ATTEMPTS:
        fail(session, artifact, f"gave up after {artifact.attempts} attempts")
        return None
    now = utcnow()
    if not claim(
        session,
        artifact,
        status=ArtifactStatus.running,
        worker=worker,
        waiting=None,
        heartbeat_at=now,
        started_at=artifact.started_at or now,
        bytes_done=0,
        updated_at=now,
    ):
        return None
    return artifact


def heartbeat(session: Session, artifact: Artifact) -> None:
    """The build's supervisor is alive."""
    session.execute(update(Artifact).where(col(Artifact.id) == artifact.id).values(heartbeat_at=utcnow()))
    session.commit()


def requeue_stale(session: Session, pool: str) -> list[str]:
    """Re-queue the builds on this pool's queue whose supervisor stopped beating (its worker was
    killed or lost), as ``runs.requeue_stale`` does for runs."""
    cutoff = utcnow() - get_settings().stale_after
    stale = session.exec(
        select(Artifact)
        .join(Run, col(Run.id) == Artifact.run_id)
        .where(Run.pool == pool, Artifact.status == ArtifactStatus.running, col(Artifact.heartbeat_at) < cutoff)
    ).all()
    for artifact in stale:
        artifact.worker, artifact.heartbeat_at = None, utcnow()  # re-queued again only after another silence
        artifact.error = f"attempt {artifact.attempts} lost its worker: re-queued"
        session.add(artifact)
        session.commit()
        queue.send_task(queue.BUILD_ARTIFACT, artifact.id, queue=pool)
    return [a.id for a in stale]


def progress(session: Session, artifact: Artifact, done: int, total: int) -> None:
    artifact.bytes_done, artifact.bytes_total, artifact.updated_at = done, total, utcnow()
    session.add(artifact)
    session.commit()


def succeed(session: Session, artifact: Artifact, files: list[dict], verification: dict | None) -> None:
    artifact.files = files
    artifact.verification = verification
    artifact.bytes_done = artifact.bytes_total = sum(f["size"] for f in files)
    _finish(session, artifact, ArtifactStatus.succeeded, None)


def fail(session: Session, artifact: Artifact, error: str, verification: dict | None = None) -> None:
    if verification is not None:
        artifact.verification = verification
    _finish(session, artifact, ArtifactStatus.failed, error)


def _finish(session: Session, artifact: Artifact, status: ArtifactStatus, error: str | None) -> None:
    artifact.status, artifact.error = status, error
    artifact.finished_at = artifact.updated_at = utcnow()
    session.add(artifact)
    session.commit()


def delete(session: Session, artifact: Artifact) -> None:
    if artifact.status in ACTIVE:
        raise ArtifactError("id", f"artifact {artifact.id} is {artifact.status}: wait for it to finish", conflict=True)
    serving = session.exec(
        select(Endpoint.id).where(Endpoint.artifact_id == artifact.id, col(Endpoint.status).in_(ENDPOINT_ACTIVE))
    ).first()
    if serving is not None:
        raise ArtifactError("id", f"endpoint {serving} serves artifact {artifact.id}: stop it first", conflict=True)
    fs, root = _fs(artifact.path)
    if fs.exists(root):
        fs.rm(root, recursive=True)
    shutil.rmtree(build_dir(artifact.id), ignore_errors=True)
    session.delete(artifact)
    session.commit()


def open_file(artifact: Artifact, name: str):
    """(filesystem, path, size) of the file ``name`` of a succeeded artifact, if it lists it (never a
    path outside it); None otherwise."""
    entry = next((f for f in artifact.files if f["path"] == name), None)
    if artifact.status != ArtifactStatus.succeeded or entry is None:
        return None
    fs, root = _fs(artifact.path)
    return fs, posixpath.join(root, name), entry["size"]
