"""Runs: the one place a run's state changes.

    validating_files -> queued -> running -> succeeded | failed | cancelled
                                  running <-> paused (pause keeps the checkpoint; resume re-queues)

Workers call `start`, `record_*`, `finish`, `fail`; users call `create`, `cancel`, `pause`, `resume`,
`delete`.
"""

import shutil
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlmodel import Session, col, func, select

from app.artifacts import service as artifacts
from app.artifacts.models import Artifact
from app.auth import service as users
from app.auth.models import User
from app.base_models import service as base_models
from app.core import queue
from app.core.config import get_settings
from app.core.db import claim, utcnow
from app.core.echo import echo
from app.core.security import new_id
from app.datasets import service as datasets
from app.datasets.models import Dataset, DatasetStatus
from app.pools.models import Pool
from app.runs.estimate import Estimate, estimate
from app.runs.models import (
    MODEL_ID_LENGTH,
    TERMINAL,
    Run,
    RunCheckpoint,
    RunConfig,
    RunCreate,
    RunEvent,
    RunMetric,
    RunProcess,
    RunPublic,
    RunStatus,
)

MAX_LOST_ATTEMPTS = 3  # a run whose worker goes silent this often (it may be what kills it) gives up


@dataclass
class RunInvalid(Exception):
    """A request that names a thing that does not fit; `loc` is the field's path in the body."""

    loc: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        return f"{'.'.join(self.loc)}: {self.message}"


class StateError(Exception):
    pass


def run_dir(run_id: str) -> Path:
    """Where a run's worker writes its attempts' logs, and its checkpoints unless it runs on a slice."""
    return get_settings().data_dir / "runs" / run_id


def output_dir(session: Session, run: Run) -> Path:
    """Where a run's checkpoints are written: its directory in the data dir, or for a run on a multi-host
    slice, in its pool's shared directory (every host of the slice writes its part of each save there)."""
    pool = session.get(Pool, run.pool)
    if pool is not None and pool.hosts_per_slice > 1 and pool.shared_dir:
        return Path(pool.shared_dir) / "runs" / run.id
    return run_dir(run.id)


def model_id(base_model: str, suffix: str | None, run_id: str) -> str:
    """The model id of a run's result (OpenAI's fine_tuned_model)."""
    return f"ft:{base_model}:{suffix or 'tunedeck'}:{run_id}"


def fine_tuned_model_name(run: Run) -> str:
    return model_id(run.base_model, run.suffix, run.id)


def _check_model_id(data: RunCreate) -> None:
    """The model id the run gets when it succeeds must fit its column: a long base-model name leaves
    less room for the suffix. Raises RunInvalid('suffix')."""
    name, limit = model_id(data.base_model, data.suffix, new_id("run")), MODEL_ID_LENGTH
    if len(name) > limit:
        room = limit - (len(name) - len(data.suffix or ""))
        raise RunInvalid(
            ("suffix",),
            f"the model id ft:{data.base_model}:SUFFIX:RUN_ID would be {len(name)} characters, over {limit}: "
            f"with this base model the suffix can have at most {room}",
        )


def event(session: Session, run: Run, message: str, level: str = "info") -> None:
    session.add(RunEvent(run_id=run.id, message=message, level=level))


def _dataset(session: Session, owner: User, dataset_id: str, field: str) -> Dataset:
    dataset = datasets.get_dataset(session, owner, dataset_id)
    if dataset is None:
        raise RunInvalid((field,), f"unknown dataset {echo(dataset_id)}")
    if dataset.status == DatasetStatus.invalid:
        raise RunInvalid((field,), f"dataset {dataset_id} is invalid ({dataset.error_count} errors): fix and re-upload")
    if dataset.format == "preference":
        raise RunInvalid(
            (field,),
            f"dataset {dataset_id} holds preference pairs (prompt, chosen, rejected): a run fine-tunes on chat, "
            "prompt_completion, alpaca or text records",
        )
    return dataset


def resolve_mesh(config: RunConfig, pool: Pool) -> tuple[int, int, int]:
    """(dp, fsdp, tp): the config's, with fsdp taking the pool's chips that dp and tp leave."""
    tp = config.mesh_tp or 1
    dp = config.mesh_dp or 1
    fsdp = config.mesh_fsdp or max(1, pool.chips // (dp * tp))
    return dp, fsdp, tp


def check(session: Session, owner: User, data: RunCreate) -> tuple[Pool, list[Dataset]]:
    """Everything about a request that needs the database or the base model; raises RunInvalid."""
    try:
        base, _ = base_models.resolve(session, data.base_model)
    except base_models.BaseModelError as exc:
        raise RunInvalid((exc.field,), str(exc)) from exc
    _check_model_id(data)
    pool = session.get(Pool, data.pool)
    if pool is None:
        raise RunInvalid(("pool",), f"unknown pool {echo(data.pool)}")
    used = [_dataset(session, owner, data.dataset_id, "dataset_id")]
    if data.validation_dataset_id is not None:
        used.append(_dataset(session, owner, data.validation_dataset_id, "validation_dataset_id"))
    if any(d.format not in (None, "text") for d in used):  # chat records are rendered by the model's template
        try:
            base_models.check_chat_template(session, data.base_model)
        except base_models.BaseModelError as exc:
            raise RunInvalid((exc.field,), str(exc)) from exc
    cfg = data.config
    if cfg.quantization:
        raise RunInvalid(
            ("config", "quantization"),
            "QLoRA is not available yet: Tunix's Gemma 4 einsum casts the weight before the einsum, "
            "which fails on Qwix's quantized weights; leave quantization empty",
        )
    if pool.hosts_per_slice > 1 and not pool.shared_dir:
        raise RunInvalid(
            ("pool",),
            f"pool {pool.name} runs on slices of {pool.hosts_per_slice} hosts but has no shared_dir: its hosts "
            "save each checkpoint together into one directory (an admin sets it on the Pools page)",
        )
    dp, fsdp, tp = resolve_mesh(cfg, pool)
    arch = base.arch
    sharded = {
        "attention heads": arch.num_heads,
        "KV heads": arch.num_kv_heads,
        "global KV heads": arch.global_kv_heads,
        "vocabulary": arch.vocab_size,
        "MLP width": arch.ffn_dim,
    }
    uneven = [f"{name} ({n})" for name, n in sharded.items() if n % tp]
    if uneven:
        raise RunInvalid(("config", "mesh_tp"), f"tp={tp} must divide the model's {', '.join(uneven)}")
    if arch.d_model % fsdp:
        raise RunInvalid(("config", "mesh_fsdp"), f"fsdp={fsdp} must divide the model width ({arch.d_model})")
    if pool.accelerator != "cpu" and dp * fsdp * tp != pool.chips:
        field = "mesh_dp" if cfg.mesh_dp and pool.chips % (dp * tp) else "mesh_fsdp"
        raise RunInvalid(
            ("config", field), f"dp x fsdp x tp = {dp * fsdp * tp} but pool {pool.name} has {pool.chips} chips"
        )
    micro = cfg.batch_size // cfg.grad_accum_steps
    if micro % (dp * fsdp):
        raise RunInvalid(
            ("config", "batch_size"),
            f"the per-step batch {micro} (batch_size / grad_accum_steps) must divide by the data-parallel size "
            f"{dp * fsdp} (dp x fsdp)",
        )
    return pool, used


def preflight(session: Session, owner: User, data: RunCreate) -> Estimate:
    """What the run will need on its pool, before it is launched (raises RunInvalid like create)."""
    pool, used = check(session, owner, data)
    dp, fsdp, tp = resolve_mesh(data.config, pool)
    tokens = used[0].stats.get("tokens_total") if used[0].stats else None
    return estimate(base_models.resolve(session, data.base_model)[0], data.config, pool, fsdp, tp, tokens, dp=dp)


def cost_usd(session: Session, run: Run) -> float:
    """Chip-hours so far (or in all, once finished) x the pool's price per chip-hour."""
    pool = session.get(Pool, run.pool)
    if pool is None or run.started_at is None:
        return 0.0
    end = run.finished_at or utcnow()
    return (end - run.started_at).total_seconds() / 3600 * pool.chips * pool.price_per_chip_hour


def to_public(session: Session, run: Run) -> RunPublic:
    processes = processes_of(session, run) if run.slice else []
    return RunPublic.model_validate(run, update={"cost_usd": round(cost_usd(session, run), 6), "processes": processes})


def check_fits(session: Session, data: RunCreate, pool: Pool) -> Estimate:
    """The memory estimate on the pool's chips; raises RunInvalid naming the field to lower (the
    estimate's ``lower``) when it will not fit, unless the request says ``force``."""
    dp, fsdp, tp = resolve_mesh(data.config, pool)
    est = estimate(base_models.resolve(session, data.base_model)[0], data.config, pool, fsdp, tp, None, dp=dp)
    if not est.fits and not data.force:
        assert est.lower is not None, "an estimate that does not fit names the field to lower"
        raise RunInvalid(tuple(est.lower.split(".")), f"will not fit in memory: {est.warning} (or set force)")
    return est


def create(session: Session, owner: User, data: RunCreate) -> Run:
    pool, used = check(session, owner, data)
    est = check_fits(session, data, pool)
    queue.check_broker()
    owner_id = owner.id
    assert owner_id is not None, "the owner is a saved user"
    users.check_limit(session, owner_id, "max_active_runs", lambda: count_active(session, owner_id), "active run")
    dp, fsdp, tp = resolve_mesh(data.config, pool)
    config = data.config.model_copy(update={"mesh_dp": dp, "mesh_fsdp": fsdp, "mesh_tp": tp})
    waiting = any(d.status == DatasetStatus.validating for d in used)
    assert owner.id is not None, "the owner is a saved user"
    run = Run(
        id=new_id("run"),
        owner_id=owner.id,
        base_model=data.base_model,
        dataset_id=data.dataset_id,
        validation_dataset_id=data.validation_dataset_id,
        pool=pool.name,
        suffix=data.suffix,
        config=config.model_dump(),
        status=RunStatus.validating_files if waiting else RunStatus.queued,
        total_steps=config.max_steps,
    )
    session.add(run)
    event(session, run, f"created on pool {pool.name} from {data.base_model}")
    if not est.fits:
        event(session, run, f"launched with force although it will likely not fit in memory: {est.warning}", "warn")
    session.commit()
    session.refresh(run)
    if not waiting:
        _enqueue(session, run)
    return run


def _enqueue(session: Session, run: Run) -> None:
    event(session, run, f"queued on pool {run.pool}")
    run.updated_at = utcnow()
    session.add(run)
    session.commit()
    queue.send_task(queue.TRAIN_RUN, run.id, queue=run.pool)


def waiting_tasks(session: Session) -> list[queue.Waiting]:
    """Runs on no worker that wait for one: queued, or re-queued after their worker was lost."""
    rows = session.exec(
        select(Run.id, Run.pool, Run.updated_at, Run.heartbeat_at).where(
            col(Run.status).in_([RunStatus.queued, RunStatus.running]), col(Run.worker).is_(None)
        )
    ).all()
    return [queue.Waiting(queue.TRAIN_RUN, pool, id_, max(at, beat or at)) for id_, pool, at, beat in rows]


def on_dataset_validated(session: Session, dataset: Dataset) -> None:
    """Runs that waited for this dataset move on: queued, or failed if it turned out invalid."""
    waiting = session.exec(
        select(Run).where(
            Run.status == RunStatus.validating_files,
            (Run.dataset_id == dataset.id) | (Run.validation_dataset_id == dataset.id),
        )
    ).all()
    for run in waiting:
        if dataset.status == DatasetStatus.invalid:
            _finish(session, run, RunStatus.failed, f"dataset {dataset.id} is invalid ({dataset.error_count} errors)")
            continue
        others = [session.get_one(Dataset, i) for i in (run.dataset_id, run.validation_dataset_id) if i]
        if all(d.status == DatasetStatus.ready for d in others):
            run.status = RunStatus.queued
            session.add(run)
            _enqueue(session, run)


def count_active(session: Session, owner_id: int) -> int:
    """The user's runs that are not over (what ``max_active_runs`` limits)."""
    where = (col(Run.owner_id) == owner_id, col(Run.status).not_in(TERMINAL))
    return session.exec(select(func.count()).select_from(Run).where(*where)).one()


def list_runs(session: Session, owner: User, *, limit: int = 100, offset: int = 0, status: RunStatus | None = None):
    where = [Run.owner_id == owner.id]
    if status is not None:
        where.append(Run.status == status)
    count = session.exec(select(func.count()).select_from(Run).where(*where)).one()
    rows = session.exec(
        select(Run).where(*where).order_by(col(Run.created_at).desc(), col(Run.id).desc()).offset(offset).limit(limit)
    ).all()
    return list(rows), count


def get(session: Session, owner: User, run_id: str) -> Run | None:
    run = session.get(Run, run_id)
    return run if run is not None and run.owner_id == owner.id else None


def events(session: Session, run: Run, *, limit: int = 100, after: int | None = None) -> list[RunEvent]:
    query = select(RunEvent).where(RunEvent.run_id == run.id)
    if after is not None:
        query = query.where(col(RunEvent.id) < after)
    return list(session.exec(query.order_by(col(RunEvent.id).desc()).limit(limit)))


def metrics(session: Session, run: Run, *, since_step: int = -1, after_id: int = 0) -> list[RunMetric]:
    """Metric rows in the order written; `after_id` follows a live run (an eval row for step N can be
    written after the training row of step N went out, so steps alone would skip it)."""
    return list(
        session.exec(
            select(RunMetric)
            .where(RunMetric.run_id == run.id, col(RunMetric.step) > since_step, col(RunMetric.id) > after_id)
            .order_by(col(RunMetric.id))
        )
    )


def checkpoints(session: Session, run: Run) -> list[RunCheckpoint]:
    return list(
        session.exec(select(RunCheckpoint).where(RunCheckpoint.run_id == run.id).order_by(col(RunCheckpoint.step)))
    )


# --- user actions -------------------------------------------------------------------------------


def cancel(session: Session, run: Run) -> Run:
    if run.status in TERMINAL:
        raise StateError(f"run {run.id} is already {run.status}")
    if run.status == RunStatus.running:
        run.stop_requested = "cancel"
        event(session, run, "cancellation requested")
        session.add(run)
        session.commit()
    else:  # nothing is running: cancel at once (a queued task finds the run cancelled and skips it)
        _finish(session, run, RunStatus.cancelled, None)
    session.refresh(run)
    return run


def pause(session: Session, run: Run) -> Run:
    if run.status != RunStatus.running:
        raise StateError(f"only a running run can be paused; run {run.id} is {run.status}")
    run.stop_requested = "pause"
    event(session, run, "pause requested")
    session.add(run)
    session.commit()
    session.refresh(run)
    return run


def resume(session: Session, run: Run) -> Run:
    if run.status != RunStatus.paused:
        raise StateError(f"only a paused run can be resumed; run {run.id} is {run.status}")
    queue.check_broker()
    # on no worker until one takes it (a queued run that names a worker was handed back by it)
    run.status, run.stop_requested, run.worker = RunStatus.queued, None, None
    session.add(run)
    _enqueue(session, run)
    session.refresh(run)
    return run


def delete(session: Session, run: Run) -> None:
    """Delete a finished run: its events, metrics and checkpoints, then its files (checkpoints and logs).
    An active run must be cancelled first, and the artifacts made from it deleted first (an endpoint
    serves an artifact, and an adapter is served on the run's base)."""
    if run.status not in TERMINAL:
        cancelling = run.stop_requested == "cancel"
        then = "it is being cancelled: delete it once it has stopped" if cancelling else "cancel it first"
        raise StateError(f"run {run.id} is {run.status}: {then}")
    query = select(Artifact.id).where(col(Artifact.run_id) == run.id).order_by(col(Artifact.created_at))
    made = session.exec(query).all()
    if made:
        raise StateError(f"run {run.id} has artifacts {', '.join(made)}: delete them first")
    for table in (RunEvent, RunMetric, RunCheckpoint):
        session.execute(sa.delete(table).where(col(table.run_id) == run.id))
    checkpoints = output_dir(session, run)
    session.execute(sa.delete(RunProcess).where(col(RunProcess.run_id) == run.id))
    session.delete(run)
    session.commit()
    shutil.rmtree(run_dir(run.id), ignore_errors=True)
    shutil.rmtree(checkpoints, ignore_errors=True)


# --- worker side --------------------------------------------------------------------------------


def start(session: Session, run_id: str, worker: str) -> Run | None:
    """A worker takes the run; None when there is nothing to do (cancelled, done, taken, or too many tries).

    Taking is a compare-and-set on `attempts` (`claim`), so two deliveries of the same task cannot both run it.
    """
    run = session.get(Run, run_id)
    if run is None or not _startable(run):
        return None
    if run.lost_attempts >= MAX_LOST_ATTEMPTS:
        _finish(session, run, RunStatus.failed, f"gave up: its worker was lost {run.lost_attempts} times")
        return None
    lost = run.status == RunStatus.running  # re-queued: the last worker died mid-run
    now = utcnow()
    if not claim(
        session,
        run,
        status=RunStatus.running,
        worker=worker,
        phase=None,
        stop_requested=None,
        started_at=run.started_at or now,
        heartbeat_at=now,
        updated_at=now,
    ):
        return None
    event(session, run, f"attempt {run.attempts} on {worker}" + (" after a worker was lost" if lost else ""))
    session.commit()
    return run


def _startable(run: Run) -> bool:
    """Queued, or running on a worker that was lost (a re-queued run has none)."""
    if run.status in TERMINAL or run.status == RunStatus.paused:
        return False
    if run.status == RunStatus.running and run.worker and run.heartbeat_at:
        return utcnow() - run.heartbeat_at >= get_settings().stale_after  # else another worker is on it
    return True


def wait_for_chips(session: Session, run_id: str, why: str, retry_s: float) -> None:
    """The host that got the run's task has its chips taken (``why`` says by what): the run says so, and its
    task is sent again in ``retry_s``, to this host or another of the pool."""
    run = session.get(Run, run_id)
    if run is None or not _startable(run):
        return  # cancelled, paused or taken meanwhile: nothing to wait for
    last = session.exec(
        select(RunEvent.message).where(RunEvent.run_id == run.id).order_by(col(RunEvent.id).desc()).limit(1)
    ).first()
    if last != why:
        event(session, run, why)
    run.phase = "waiting for chips"
    run.updated_at = utcnow()  # it is not lost: `resend_lost` counts from here
    session.add(run)
    session.commit()
    queue.send_task(queue.TRAIN_RUN, run.id, queue=run.pool, countdown=retry_s)


def is_current(session: Session, run: Run, attempt: int) -> bool:
    """Whether `attempt` still owns the run (it was not finished, paused, or taken by a later attempt)."""
    session.refresh(run)
    return run.attempts == attempt and run.status == RunStatus.running


def requeue_stale(session: Session, pool: str) -> list[str]:
    """Re-queue this pool's running runs whose worker stopped beating (it was killed or lost), and the
    runs handed back by a worker that was killed before it queued them."""
    cutoff = utcnow() - get_settings().stale_after
    stale = session.exec(
        select(Run).where(
            Run.pool == pool,
            # running, or handed back by a worker killed before it could queue them (it still names it)
            (col(Run.status) == RunStatus.running)
            | ((col(Run.status) == RunStatus.queued) & col(Run.worker).is_not(None)),
            col(Run.heartbeat_at) < cutoff,
        )
    ).all()
    for run in stale:
        silent = f"no heartbeat from {run.worker or 'any worker'} for {get_settings().stale_after.seconds}s"
        requeue_lost(session, run, silent)
    return [r.id for r in stale]


def requeue_lost(session: Session, run: Run, why: str) -> None:
    """Its worker (or on a slice, one of its hosts) was lost: queue the run again, to resume from its last
    checkpoint, counting a lost attempt if it was running."""
    event(session, run, f"{why}: re-queued", "warn")
    run.lost_attempts += run.status == RunStatus.running
    # ownerless, so re-queued again only after another silence; a slice's hosts see the coordinator gone
    run.worker, run.heartbeat_at, run.coordinator = None, utcnow(), None
    session.add(run)
    session.commit()
    queue.send_task(queue.TRAIN_RUN, run.id, queue=run.pool)


def hand_back(session: Session, worker: str) -> list[str]:
    """The worker is stopping (SIGTERM: a restart, a deploy, a preempted host): each of its running
    runs is asked to save a checkpoint at the step it is on and stop (``finish(stopped_by="handback")``
    leaves it queued, still naming the worker); ``requeue_handed_back`` sends their tasks once the worker
    takes no more, and the next worker of the pool resumes each from its checkpoint."""
    running = session.exec(
        select(Run).where(Run.worker == worker, Run.status == RunStatus.running, col(Run.stop_requested).is_(None))
    ).all()
    for run in running:
        run.stop_requested = "handback"
        event(session, run, f"{worker} is stopping: saving a checkpoint to hand the run back")
        session.add(run)
    # Its part of a run on a slice (another host's is host 0): host 0 passes the stop to the slice's
    # processes, which decide it once and stop at the same step, with a checkpoint there.
    parts = session.exec(
        select(Run, RunProcess)
        .join(RunProcess, col(RunProcess.run_id) == col(Run.id))
        .where(
            RunProcess.worker == worker,
            col(RunProcess.attempt) == col(Run.attempts),
            col(RunProcess.host_index) > 0,
            Run.status == RunStatus.running,
            col(Run.stop_requested).is_(None),
        )
    ).all()
    for run, part in parts:
        run.stop_requested = "handback"
        host = f"host {part.host_index} of slice {run.slice}"
        event(session, run, f"{worker} ({host}) is stopping: saving a checkpoint to hand the run back")
        session.add(run)
    session.commit()
    return [r.id for r in running] + [r.id for r, _ in parts]


def requeue_handed_back(session: Session, worker: str) -> list[str]:
    """The runs this stopped worker handed back, on their pool's queue again (see ``hand_back``): its own,
    and those of a slice it had a part in (a row that waits longer, its task lost, is sent again by
    ``queue.resend_lost``)."""
    own = col(Run.worker) == worker
    part = col(Run.id).in_(
        select(RunProcess.run_id).where(RunProcess.worker == worker, col(RunProcess.attempt) == col(Run.attempts))
    )
    handed = session.exec(select(Run).where(sa.or_(own, part), Run.status == RunStatus.queued)).all()
    for run in handed:
        run.worker = None
        session.add(run)
        _enqueue(session, run)
    return [r.id for r in handed]


def heartbeat(session: Session, run: Run, *, phase: str | None = None) -> str | None:
    """Record liveness (and phase); returns the pending stop request, if any."""
    session.refresh(run)
    run.heartbeat_at = run.updated_at = utcnow()
    if phase is not None and phase != run.phase:
        run.phase = phase
        event(session, run, f"phase: {phase}")
    session.add(run)
    session.commit()
    return run.stop_requested


def rewind(session: Session, run: Run, step: int) -> None:
    """A new attempt resumes after `step`: forget what a lost attempt reported beyond it."""
    session.execute(sa.delete(RunMetric).where(col(RunMetric.run_id) == run.id, col(RunMetric.step) > step))
    run.step = max(step, 0)
    session.add(run)
    said = (
        f"resumed from step {step}"
        if step > 0
        else "started over (no checkpoint): the earlier attempt's points dropped"
    )
    event(session, run, said)
    session.commit()


def record_metrics(session: Session, run: Run, rows: list[tuple[int, dict[str, float]]]) -> None:
    for step, values in rows:
        session.add(RunMetric(run_id=run.id, step=step, values=values))
    evals = {step: values["eval_loss"] for step, values in rows if "eval_loss" in values}
    if evals:  # a step's evaluation runs after its checkpoint is saved: complete the checkpoint's metrics
        query = select(RunCheckpoint).where(RunCheckpoint.run_id == run.id, col(RunCheckpoint.step).in_(list(evals)))
        for ckpt in session.exec(query):
            ckpt.metrics = {**ckpt.metrics, "eval_loss": evals[ckpt.step]}
            session.add(ckpt)
    if rows:
        run.step = max(run.step, max(step for step, _ in rows))
        run.updated_at = utcnow()
        session.add(run)
    session.commit()


def record_checkpoint(
    session: Session, run: Run, step: int, path: str, values: dict[str, float], kept: list[int]
) -> None:
    """A checkpoint was saved at ``step``; ``kept`` are the steps still on disk (older ones were pruned
    to honour ``checkpoints_kept``): the list shows what can still be resumed from or merged."""
    rows = session.exec(select(RunCheckpoint).where(RunCheckpoint.run_id == run.id)).all()
    if not any(c.step == step for c in rows):
        session.add(RunCheckpoint(run_id=run.id, step=step, path=path, metrics=values))
        event(session, run, f"checkpoint saved at step {step}")
    pruned = sorted(c.step for c in rows if c.step not in kept and c.step != step)
    for ckpt in rows:
        if ckpt.step in pruned:
            session.delete(ckpt)
    if pruned:
        steps = ", ".join(map(str, pruned))
        event(
            session,
            run,
            f"removed the checkpoint(s) at step {steps} (checkpoints_kept={run.config['checkpoints_kept']})",
        )
    session.commit()


def held_out(session: Session, run: Run, lines: list[int]) -> None:
    """Training split its file: these records (by line) are its validation split, not trained on."""
    run.held_out_lines = lines
    session.add(run)
    session.commit()


def log(session: Session, run: Run, message: str, level: str = "info") -> None:
    event(session, run, message, level)
    session.commit()


def finish(session: Session, run: Run, *, stopped_by: str | None) -> None:
    session.refresh(run)
    if run.status in TERMINAL:
        return
    if stopped_by == "pause":
        run.status, run.stop_requested, run.phase = RunStatus.paused, None, None
        event(session, run, f"paused at step {run.step}")
        session.add(run)
        session.commit()
    elif stopped_by == "cancel":
        _finish(session, run, RunStatus.cancelled, None)
    elif stopped_by == "handback":  # queued again by its worker once it has stopped taking tasks
        run.status, run.stop_requested, run.phase, run.heartbeat_at = RunStatus.queued, None, None, utcnow()
        event(session, run, f"handed back at step {run.step}, with a checkpoint there")
        session.add(run)
        session.commit()
    else:
        run.fine_tuned_model = fine_tuned_model_name(run)
        # its merged artifact first: whoever sees the run succeeded finds the artifact listed
        artifacts.on_run_succeeded(session, run)
        _finish(session, run, RunStatus.succeeded, None)
        if run.config.get("eval_every_checkpoint"):
            _evaluate_checkpoints(session, run)


def _evaluate_checkpoints(session: Session, run: Run) -> None:
    """The checkpoint sweep its config asks for, started once it has succeeded (while it trained, its
    chips were the training's): a run event names the evaluation, or why none could start."""
    from app.evaluations import service as evaluations

    try:
        evaluation = evaluations.sweep(session, session.get_one(User, run.owner_id), run)
        event(session, run, f"evaluating every checkpoint and the base model: {evaluation.id}")
    except evaluations.EvaluationError as exc:
        event(session, run, f"could not start the checkpoint evaluation: {exc}", level="warning")
    session.commit()


def fail(session: Session, run: Run, error: str) -> None:
    session.refresh(run)
    _finish(session, run, RunStatus.failed, error)


def _finish(session: Session, run: Run, status: RunStatus, error: str | None) -> None:
    if run.status in TERMINAL:  # an outcome, once recorded, stays
        return
    run.status, run.error, run.stop_requested, run.phase = status, error, None, None
    run.finished_at = run.updated_at = utcnow()
    session.add(run)
    event(session, run, f"{status.value}" + (f": {error}" if error else ""), "error" if error else "info")
    session.commit()


# --- a run on a multi-host slice ----------------------------------------------------------------
#
# A worker of a slice pool that takes a run (``start``) hands it to its slice: one task on each host's
# queue (``gang_start``). Each host's task ``join``s with a process row it beats; host 0 records where the
# processes meet (``set_coordinator``) and beats the run as a single host does; every host stops its
# process once the run is no longer this attempt with this coordinator (``on_slice``): finished, failed,
# or re-queued because a host fell silent (``silent_hosts``, then ``requeue_lost``).


def gang_start(session: Session, run: Run, slice_: str, hosts: int) -> None:
    run.slice, run.coordinator = slice_, None
    session.execute(sa.delete(RunProcess).where(col(RunProcess.run_id) == run.id))
    event(session, run, f"on slice {slice_}: starting its process on each of its {hosts} hosts")
    session.add(run)
    session.commit()
    for index in range(hosts):
        to = queue.host_queue(run.pool, slice_, index)
        queue.send_task(queue.TRAIN_ON_HOST, run.id, run.attempts, index, queue=to)


def host_waits_for_chips(
    session: Session, run_id: str, attempt: int, host_index: int, worker: str, why: str, retry_s: float
) -> None:
    """Host ``host_index``'s chips are taken (``why`` says by what): its process row says "waiting" (the
    event says why, once), and its part's task is sent again to its queue in ``retry_s``. The other hosts
    wait for it as for any host that has not joined yet."""
    run = session.get(Run, run_id)
    if run is None or not is_current(session, run, attempt) or run.slice is None:
        return
    row = session.get(RunProcess, (run_id, host_index))
    if row is not None and row.attempt == attempt and row.state != "waiting":
        return  # this host's part runs already (a second delivery of its task)
    said = row is not None and row.attempt == attempt  # waiting already: its event is out
    row = row or RunProcess(run_id=run_id, host_index=host_index, attempt=attempt, worker=worker, state="waiting")
    row.attempt, row.worker, row.state, row.step, row.step_time_s = attempt, worker, "waiting", 0, None
    row.heartbeat_at = utcnow()
    session.add(row)
    if not said:
        event(session, run, f"host {host_index} of slice {run.slice}: {why}")
    if host_index == 0:  # the run's heartbeat is host 0's: waiting for its chips, the run is not lost
        run.heartbeat_at = run.updated_at = utcnow()
        session.add(run)
    session.commit()
    to = queue.host_queue(run.pool, run.slice, host_index)
    queue.send_task(queue.TRAIN_ON_HOST, run.id, attempt, host_index, queue=to, countdown=retry_s)


def join(session: Session, run_id: str, attempt: int, host_index: int, worker: str) -> Run | None:
    """One host of the slice takes its part of ``attempt``; None when that attempt is over."""
    run = session.get(Run, run_id)
    if run is None or not is_current(session, run, attempt) or run.slice is None:
        return None
    row = session.get(RunProcess, (run_id, host_index))
    if row is not None and row.attempt == attempt and row.state != "waiting":
        return None  # a second delivery of the same host's task
    row = row or RunProcess(run_id=run_id, host_index=host_index, attempt=attempt, worker=worker, state="joining")
    row.attempt, row.worker, row.state, row.step, row.step_time_s = attempt, worker, "joining", 0, None
    row.heartbeat_at = utcnow()
    session.add(row)
    if host_index == 0:
        run.worker = worker  # the run's heartbeat, its stop requests and its hand-back are host 0's
        session.add(run)
    event(session, run, f"host {host_index} of slice {run.slice} ({worker}) is joining")
    session.commit()
    return run


def set_coordinator(session: Session, run: Run, address: str) -> None:
    run.coordinator = address
    session.add(run)
    event(session, run, f"the slice's processes meet at {address} (host 0)")
    session.commit()


def process_beat(
    session: Session,
    run_id: str,
    host_index: int,
    *,
    state: str | None = None,
    step: int | None = None,
    step_time_s: float | None = None,
) -> None:
    row = session.get(RunProcess, (run_id, host_index))
    if row is None:
        return
    row.heartbeat_at = utcnow()
    row.state = state or row.state
    if step is not None:
        row.step, row.step_time_s = step, step_time_s
    session.add(row)
    session.commit()


def on_slice(session: Session, run: Run, attempt: int, coordinator: str | None) -> bool:
    """Whether this host's process still belongs to the run: the same attempt, meeting at the same place."""
    return is_current(session, run, attempt) and run.coordinator == coordinator


def silent_hosts(session: Session, run: Run, attempt: int) -> list[int]:
    """The hosts whose process of ``attempt`` stopped beating for longer than the stale bound (one that never
    joins is JAX's to report: the processes' start times out)."""
    cutoff = utcnow() - get_settings().stale_after
    rows = processes_of(session, run)
    return [p.host_index for p in rows if p.attempt == attempt and p.heartbeat_at < cutoff]


def processes_of(session: Session, run: Run) -> list[RunProcess]:
    query = select(RunProcess).where(RunProcess.run_id == run.id).order_by(col(RunProcess.host_index))
    return list(session.exec(query).all())
