"""OpenAI-compatible fine-tuning jobs (/v1/fine_tuning/jobs): a thin adapter over the runs service.

Tunedeck's own settings ride under one extra key, `tunedeck`: {"pool": ..., "config": {...}}
(with the SDK: `extra_body={"tunedeck": {...}}`).
"""

from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, status
from pydantic import BeforeValidator, Field, ValidationError

from app.core.deps import CurrentUser, SessionDep
from app.core.routing import Route
from app.core.schemas import ID_LENGTH, INT32_MAX, NAME_LENGTH, Schema
from app.runs import service
from app.runs.models import Run, RunConfig, RunCreate, RunStatus

router = APIRouter(route_class=Route, prefix="/v1/fine_tuning/jobs", tags=["openai"])

BASE_LEARNING_RATE = RunConfig.model_fields["learning_rate"].default


def _auto(value: Any) -> Any:
    return None if value == "auto" else value


def _or_auto(schema: dict) -> None:
    schema["anyOf"].append({"const": "auto"})


# OpenAI's "auto" (read as None: Tunedeck's default), or a value within bounds. Not a union with
# Literal["auto"]: pydantic would name the union's member in an error's location.
Auto = (BeforeValidator(_auto), Field(json_schema_extra=_or_auto))


class Hyperparameters(Schema):
    n_epochs: Annotated[Annotated[int, Field(ge=1, le=1000)] | None, *Auto] = None
    batch_size: Annotated[Annotated[int, Field(ge=1, le=65536)] | None, *Auto] = None
    # the run's learning rate is this times 1e-3, at most 1
    learning_rate_multiplier: Annotated[Annotated[float, Field(gt=0, le=1 / BASE_LEARNING_RATE)] | None, *Auto] = None


class Supervised(Schema):
    hyperparameters: Hyperparameters | None = None


class Method(Schema):
    type: Literal["supervised"] = "supervised"
    supervised: Supervised | None = None


class TunedeckExtra(Schema):
    pool: str = Field(default="cpu", max_length=NAME_LENGTH)
    config: dict[str, Any] = Field(default_factory=dict)  # a RunConfig, validated as one
    force: bool = False  # launch even if the memory estimate says it will not fit


class JobCreate(Schema):
    model: str = Field(max_length=NAME_LENGTH)
    training_file: str = Field(max_length=ID_LENGTH)
    validation_file: str | None = Field(default=None, max_length=ID_LENGTH)
    hyperparameters: Hyperparameters | None = None
    suffix: str | None = Field(default=None, max_length=64)
    seed: int | None = Field(default=None, ge=0, le=INT32_MAX)
    method: Method | None = None
    tunedeck: TunedeckExtra = Field(default_factory=TunedeckExtra)


def _to_run_create(job: JobCreate) -> RunCreate:
    hp = job.hyperparameters or Hyperparameters()
    if job.method and job.method.supervised and job.method.supervised.hyperparameters:
        hp = job.method.supervised.hyperparameters
    config = dict(job.tunedeck.config)
    if hp.n_epochs is not None:
        config["epochs"] = hp.n_epochs
    if hp.batch_size is not None:
        config["batch_size"] = hp.batch_size
    if hp.learning_rate_multiplier is not None:
        config["learning_rate"] = BASE_LEARNING_RATE * hp.learning_rate_multiplier
    if job.seed is not None:
        config["seed"] = job.seed
    return RunCreate(
        base_model=job.model,
        dataset_id=job.training_file,
        validation_dataset_id=job.validation_file,
        pool=job.tunedeck.pool,
        suffix=job.suffix,
        config=RunConfig.model_validate(config),
        force=job.tunedeck.force,
    )


def to_job(run: Run) -> dict:
    cfg = run.config
    return {
        "id": run.id,
        "object": "fine_tuning.job",
        "created_at": int(run.created_at.timestamp()),
        "finished_at": int(run.finished_at.timestamp()) if run.finished_at else None,
        "model": run.base_model,
        "fine_tuned_model": run.fine_tuned_model,
        "organization_id": "tunedeck",
        "status": str(run.status),
        "hyperparameters": {
            "n_epochs": cfg.get("epochs") or "auto",
            "batch_size": cfg["batch_size"],
            "learning_rate_multiplier": cfg["learning_rate"] / BASE_LEARNING_RATE,
        },
        "training_file": run.dataset_id,
        "validation_file": run.validation_dataset_id,
        "result_files": [],
        "trained_tokens": None,
        "error": {"code": "run_failed", "message": run.error, "param": None}
        if run.status == RunStatus.failed
        else None,
        "seed": cfg["seed"],
        "suffix": run.suffix,
        "estimated_finish": None,
        "integrations": [],
        "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": cfg.get("epochs") or "auto"}}},
        "metadata": None,
        "tunedeck": {
            "pool": run.pool,
            "phase": run.phase,
            "step": run.step,
            "total_steps": run.total_steps,
            "config": cfg,
        },
    }


def _get(session, user, job_id: str) -> Run:
    run = service.get(session, user, job_id)
    if run is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"No such fine-tuning job: {job_id}")
    return run


@router.post("")
def create_job(job: JobCreate, session: SessionDep, user: CurrentUser) -> dict:
    try:
        data = _to_run_create(job)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"tunedeck.config.{where}: {first['msg']}") from exc
    try:
        return to_job(service.create(session, user, data))
    except service.RunInvalid as exc:
        field = {"base_model": "model", "dataset_id": "training_file", "validation_dataset_id": "validation_file"}
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, f"{field.get(exc.loc[0], '.'.join(exc.loc))}: {exc.message}"
        ) from exc


@router.get("")
def list_jobs(
    session: SessionDep, user: CurrentUser, limit: Annotated[int, Query(ge=1, le=1000)] = 20, after: str | None = None
) -> dict:
    rows, _ = service.list_runs(session, user, limit=1000)
    if after:
        ids = [r.id for r in rows]
        rows = rows[ids.index(after) + 1 :] if after in ids else []
    return {"object": "list", "data": [to_job(r) for r in rows[:limit]], "has_more": len(rows) > limit}


@router.get("/{job_id}")
def retrieve_job(job_id: str, session: SessionDep, user: CurrentUser) -> dict:
    return to_job(_get(session, user, job_id))


@router.get("/{job_id}/events")
def list_events(
    job_id: str,
    session: SessionDep,
    user: CurrentUser,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    after: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None,
) -> dict:
    rows = service.events(session, _get(session, user, job_id), limit=limit + 1, after=after)
    data = [
        {
            "id": str(e.id),
            "object": "fine_tuning.job.event",
            "created_at": int(e.created_at.timestamp()),
            "level": e.level if e.level in ("info", "warn", "error") else "info",
            "message": e.message,
            "type": "message",
        }
        for e in rows[:limit]
    ]
    return {"object": "list", "data": data, "has_more": len(rows) > limit}


@router.get("/{job_id}/checkpoints")
def list_checkpoints(job_id: str, session: SessionDep, user: CurrentUser) -> dict:
    run = _get(session, user, job_id)
    rows = service.checkpoints(session, run)
    data = [
        {
            "id": f"{run.id}-ckpt-{c.step}",
            "object": "fine_tuning.job.checkpoint",
            "created_at": int(c.created_at.timestamp()),
            "fine_tuning_job_id": run.id,
            "step_number": c.step,
            "fine_tuned_model_checkpoint": f"{service.fine_tuned_model_name(run)}:ckpt-step-{c.step}",
            "metrics": {"step": c.step, "train_loss": c.metrics.get("loss"), "valid_loss": c.metrics.get("eval_loss")},
        }
        for c in reversed(rows)
    ]
    return {
        "object": "list",
        "data": data,
        "has_more": False,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


def _act(action, job_id: str, session, user) -> dict:
    try:
        return to_job(action(session, _get(session, user, job_id)))
    except service.StateError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc


@router.post("/{job_id}/cancel")
def cancel_job(job_id: str, session: SessionDep, user: CurrentUser) -> dict:
    return _act(service.cancel, job_id, session, user)


@router.post("/{job_id}/pause")
def pause_job(job_id: str, session: SessionDep, user: CurrentUser) -> dict:
    return _act(service.pause, job_id, session, user)


@router.post("/{job_id}/resume")
def resume_job(job_id: str, session: SessionDep, user: CurrentUser) -> dict:
    return _act(service.resume, job_id, session, user)
