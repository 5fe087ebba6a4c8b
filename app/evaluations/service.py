"""Evaluations: the state machine (queued -> running -> succeeded | failed | cancelled), advanced by the
`tunedeck.evaluations.run` task on the evaluation's pool (worker/evaluations.py), which serves each
subject in turn, asks it the eval set's prompts, and records the scored samples and the summary here.
An evaluation whose worker went silent is failed by the pool's workers (``fail_stale``); the user
cancels one with ``cancel``. The only place an evaluation's state changes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import orjson
from sqlalchemy import delete as sql_delete
from sqlalchemy import update
from sqlmodel import Session, col, func, select

from app.artifacts.models import Artifact, ArtifactKind, ArtifactStatus
from app.auth.models import User
from app.core import jobs, queue
from app.core.config import get_settings
from app.core.db import owned, owned_page, utcnow
from app.core.echo import echo
from app.core.errors import FieldError
from app.core.security import new_id, seal
from app.datasets.models import Dataset, DatasetStatus
from app.endpoints.models import Endpoint, EndpointCreate, EndpointStatus
from app.evaluations import judge as judge_lib
from app.evaluations import metrics
from app.evaluations.models import (
    MAX_SUBJECTS,
    TERMINAL,
    ComparedRow,
    EvalSetComparison,
    Evaluation,
    EvaluationCreate,
    EvaluationPublic,
    EvaluationSample,
    EvaluationStatus,
    Promotion,
    Subject,
)
from app.pools.models import Pool
from app.runs.models import Run, RunCheckpoint

# Dataset formats whose records end with an answer to score against (the last assistant message: a
# preference pair's chosen answer); a `text` dataset has none.
# The newest succeeded evaluations a comparison of runs looks through.
COMPARED_EVALUATIONS = 500

WITH_REFERENCES = {"chat", "prompt_completion", "alpaca", "preference"}


class EvaluationError(FieldError):
    pass


def to_public(evaluation: Evaluation) -> EvaluationPublic:
    return EvaluationPublic(
        **evaluation.model_dump(exclude={"owner_id", "attempts", "worker", "heartbeat_at", "updated_at"}),
        cost_usd=evaluation.chip_seconds / 3600 * evaluation.price_per_chip_hour,
    )


def create(session: Session, owner: User, data: EvaluationCreate, *, pool: str | None = None) -> Evaluation:
    dataset_id, held_out = (
        _validation_split(session, owner, data.validation_of) if data.validation_of else (data.dataset_id, None)
    )
    dataset = session.get(Dataset, dataset_id)
    if dataset is None or dataset.owner_id != owner.id:
        raise EvaluationError("dataset_id", f"dataset {echo(dataset_id or '')} not found", missing=True)
    if dataset.status != DatasetStatus.ready or not dataset.valid_rows:
        raise EvaluationError("dataset_id", f"dataset {dataset.id} is {dataset.status}; evaluate on a ready one")
    if dataset.format not in WITH_REFERENCES:
        # every metric of METRICS compares with the reference
        raise EvaluationError(
            "metrics",
            f"{data.metrics[0]} compares replies with reference answers, and dataset {dataset.id} "
            f"({dataset.format} format) has none: use a chat, prompt/completion or alpaca dataset",
        )
    subjects, served_pools, endpoint_pools, run_id = [], set(), set(), None
    for i, subject in enumerate(data.subjects):
        for described in _expand(session, owner, subject, f"subjects.{i}"):
            described["key"] = f"s{len(subjects)}"
            subjects.append(described)
            if subject.kind == "endpoint":
                endpoint_pools.add(described["pool"])
            else:
                served_pools.add(described["pool"])
                run_id = run_id or described.get("run_id")
    if len(subjects) > MAX_SUBJECTS:
        raise EvaluationError(
            "subjects", f"{len(subjects)} subjects with every checkpoint counted; an evaluation takes {MAX_SUBJECTS}"
        )
    if len(served_pools) > 1:
        raise EvaluationError(
            "subjects", f"the checkpoints and base models to serve are on pools {sorted(served_pools)}: one at a time"
        )
    judge, judge_key = _judge(session, owner, data)
    where = pool or next(iter(served_pools), None) or next(iter(sorted(endpoint_pools)), None)
    pool_row = session.get(Pool, where) if where else None
    if pool_row is None:
        raise EvaluationError("pool", f"unknown pool {echo(where or '')}")
    queue.check_broker()
    assert owner.id is not None, "the owner is a saved user"
    config = {
        **data.model_dump(include=set(type(data).model_fields) - {"subjects", "dataset_id", "judge"}),
        "judge": judge,
    }
    evaluation = Evaluation(
        id=new_id("ev"),
        owner_id=owner.id,
        dataset_id=dataset.id,
        run_id=run_id,
        pool=pool_row.name,
        chips=pool_row.chips,
        price_per_chip_hour=pool_row.price_per_chip_hour,
        subjects=subjects,
        config=config,
        judge_key=judge_key,
        samples_total=min(data.max_samples, held_out or dataset.valid_rows)
        * requests_per_sample(len(subjects), config),
    )
    session.add(evaluation)
    session.commit()
    queue.send_task(queue.RUN_EVALUATION, evaluation.id, queue=evaluation.pool)
    return evaluation


def _validation_split(session: Session, owner: User, run_id: str) -> tuple[str, int | None]:
    """A run's validation split as (dataset id, rows held out of it; None: the whole dataset)."""
    run = session.get(Run, run_id)
    if run is None or run.owner_id != owner.id:
        raise EvaluationError("validation_of", f"run {echo(run_id)} not found", missing=True)
    if run.validation_dataset_id is not None:
        return run.validation_dataset_id, None
    if not run.held_out_lines:
        why = (
            "its validation_fraction is 0"
            if not run.config.get("validation_fraction")
            else "it has not loaded its data yet"
        )
        raise EvaluationError("validation_of", f"run {run.id} has no validation split: {why}")
    return run.dataset_id, len(run.held_out_lines)


def sweep(session: Session, owner: User, run: Run) -> Evaluation:
    """Every checkpoint of the run and its base model, on its validation split (else its training
    dataset), with the run page's defaults: what ``eval_every_checkpoint`` starts."""
    split = run.validation_dataset_id is not None or bool(run.held_out_lines)
    data = EvaluationCreate(
        dataset_id=None if split else run.dataset_id,
        validation_of=run.id if split else None,
        subjects=[Subject(kind="checkpoints", run_id=run.id), Subject(kind="base", run_id=run.id)],
        max_samples=50,
        max_tokens=64,
    )
    return create(session, owner, data)


def requests_per_sample(subjects: int, config: dict[str, Any]) -> int:
    """Requests an evaluation makes per sample: each subject's reply (and with ``perplexity`` its scoring
    of the reference), each judge's grade of them, and with pairwise judging, two verdicts (both
    orders) for each pair of the first subject and another."""
    judge = config.get("judge")
    per_subject = 2 if "perplexity" in config["metrics"] else 1
    if judge is None:
        return per_subject * subjects
    return (per_subject + 1) * subjects + (2 * (subjects - 1) if judge["pairwise"] else 0)


def _judge(session: Session, owner: User, data: EvaluationCreate) -> tuple[dict[str, Any] | None, str | None]:
    """The judge as stored in the config (its key apart, sealed), checked: an endpoint judge must be
    the caller's and ready; pairwise needs two subjects."""
    if data.judge is None:
        return None, None
    judge = data.judge.model_dump(exclude={"api_key"})
    if data.judge.endpoint_id is not None:
        endpoint = session.get(Endpoint, data.judge.endpoint_id)
        if endpoint is None or endpoint.owner_id != owner.id:
            raise EvaluationError(
                "judge.endpoint_id", f"endpoint {echo(data.judge.endpoint_id)} not found", missing=True
            )
        if endpoint.status != EndpointStatus.ready:
            raise EvaluationError("judge.endpoint_id", f"endpoint {endpoint.id} is {endpoint.status}; a judge is ready")
        judge["model"] = endpoint.model
    if data.judge.pairwise and len(data.subjects) < 2:
        raise EvaluationError("judge.pairwise", "pairwise judging compares subjects: give at least two")
    key = data.judge.api_key.get_secret_value() if data.judge.api_key else None
    judge["api_key"] = "(set)" if key else None
    return judge, (seal(key) if key else None)


def _expand(session: Session, owner: User, subject: Subject, field: str) -> list[dict[str, Any]]:
    """The subjects a requested one stands for: a ``checkpoints`` subject, one per checkpoint of its run."""
    if subject.kind != "checkpoints":
        return [_resolve(session, owner, subject, field)]
    one = subject.model_copy(update={"kind": "checkpoint"})
    last = _resolve(session, owner, one, field)  # the run checked, and its last checkpoint
    steps = session.exec(
        select(RunCheckpoint.step).where(RunCheckpoint.run_id == last["run_id"]).order_by(col(RunCheckpoint.step))
    ).all()
    return [{**last, "step": step, "label": f"{last['run_id']} step {step}", "sweep": True} for step in steps]


def _resolve(session: Session, owner: User, subject: Subject, field: str) -> dict[str, Any]:
    """The subject as the worker needs it (ids, pool) with a ``label`` for people; 404 when it names
    something the caller has not got, 422 when it cannot be evaluated."""
    base: dict[str, Any] = subject.model_dump(exclude_none=True)
    if subject.kind == "endpoint":
        endpoint = session.get(Endpoint, subject.endpoint_id)
        if endpoint is None or endpoint.owner_id != owner.id:
            raise EvaluationError(field, f"{field}: endpoint {echo(subject.endpoint_id or '')} not found", missing=True)
        if endpoint.status != EndpointStatus.ready:
            raise EvaluationError(field, f"{field}: endpoint {endpoint.id} is {endpoint.status}; evaluate a ready one")
        return {**base, "pool": endpoint.pool, "label": f"{endpoint.model} ({endpoint.id})"}
    if subject.run_id is not None:
        run = session.get(Run, subject.run_id)
        if run is None or run.owner_id != owner.id:
            raise EvaluationError(field, f"{field}: run {echo(subject.run_id)} not found", missing=True)
        if subject.kind == "base":
            return {**base, "base_model": run.base_model, "pool": run.pool, "label": f"{run.base_model} (base)"}
        steps = sorted(session.exec(select(RunCheckpoint.step).where(RunCheckpoint.run_id == run.id)).all())
        if not steps:
            raise EvaluationError(field, f"{field}: run {run.id} has no checkpoint yet")
        step = subject.step if subject.step is not None else steps[-1]
        if step not in steps:
            raise EvaluationError(field, f"{field}: run {run.id} has no checkpoint at step {step}; it has {steps}")
        return {**base, "step": step, "pool": run.pool, "label": f"{run.id} step {step}"}
    from app.base_models import service as base_models

    try:
        base_models.resolve(session, subject.base_model or "")
    except base_models.BaseModelError as exc:
        raise EvaluationError(field, f"{field}: {exc}", missing=True) from exc
    return {**base, "pool": get_settings().pool, "label": f"{subject.base_model} (base)"}


def compare_runs(session: Session, owner: User, run_ids: list[str]) -> list[EvalSetComparison]:
    """The runs' checkpoints (and their base models) as evaluated, grouped by eval set: for each set, a row
    per subject from its newest succeeded evaluation, and the run settings that differ between the runs
    in it. A set is the same records whatever evaluation asked them: the same dataset, the same lines held
    out (two runs with one dataset, fraction and seed hold out the same ones) and as many samples."""
    runs: dict[str, Run] = {}
    for run_id in dict.fromkeys(run_ids):
        run = session.get(Run, run_id)
        if run is None or run.owner_id != owner.id:
            raise EvaluationError("run_ids", f"run {echo(run_id)} not found", missing=True)
        runs[run_id] = run
    evaluations = session.exec(
        select(Evaluation)
        .where(Evaluation.owner_id == owner.id, Evaluation.status == EvaluationStatus.succeeded)
        .order_by(col(Evaluation.finished_at).desc())
        .limit(COMPARED_EVALUATIONS)
    ).all()
    groups: dict[str, EvalSetComparison] = {}
    seen: set[tuple[str, str]] = set()
    for evaluation in evaluations:  # newest first: the first row of a subject on a set is its newest
        mine = [
            s
            for s in evaluation.subjects
            if s.get("run_id") in runs and s["kind"] in ("checkpoint", "base") and s["key"] in evaluation.summary
        ]
        if not mine:
            continue
        key, label, samples = _eval_set(session, evaluation)
        group = groups.get(key) or groups.setdefault(
            key,
            EvalSetComparison(
                eval_set=key,
                label=label,
                dataset_id=evaluation.dataset_id,
                samples=samples,
                metrics=[],
                rows=[],
                config_differences={},
            ),
        )
        for subject in mine:
            base = subject["kind"] == "base"
            who = f"base:{subject['base_model']}" if base else f"{subject['run_id']}@{subject['step']}"
            if (key, who) in seen:
                continue
            seen.add((key, who))
            summary = evaluation.summary[subject["key"]]
            scores = {m: v for m, v in summary.items() if isinstance(v, dict) and "mean" in v}
            group.metrics.extend(m for m in scores if m not in group.metrics)
            group.rows.append(
                ComparedRow(
                    kind=subject["kind"],
                    label=subject["label"],
                    run_id=None if base else subject["run_id"],
                    step=subject.get("step"),
                    base_model=subject.get("base_model"),
                    evaluation_id=evaluation.id,
                    scores=scores,
                    chip_seconds=evaluation.chip_seconds,
                    cost_usd=evaluation.chip_seconds / 3600 * evaluation.price_per_chip_hour,
                    finished_at=evaluation.finished_at,
                )
            )
    order = {run_id: i for i, run_id in enumerate(runs)}
    for group in groups.values():
        group.rows.sort(key=lambda r: (r.run_id is None, order.get(r.run_id or "", 0), r.step or 0, r.label))
        group.config_differences = _config_differences([runs[r.run_id] for r in group.rows if r.run_id])
    return list(groups.values())


def _eval_set(session: Session, evaluation: Evaluation) -> tuple[str, str, int]:
    """An evaluation's eval set as (key, label, samples): the dataset, the lines a run held out of it
    (``validation_of``), and how many of its conversations were asked."""
    samples = evaluation.samples_total // requests_per_sample(len(evaluation.subjects), evaluation.config)
    of = evaluation.config.get("validation_of")
    split = session.get(Run, of) if of else None
    if of and (split is None or split.validation_dataset_id is None):
        lines = sorted(split.held_out_lines or []) if split else []
        digest = hashlib.sha256(orjson.dumps(lines)).hexdigest()[:16] if lines else f"run:{of}"
        key = f"{evaluation.dataset_id}:lines:{digest}:{samples}"
        label = f"dataset {evaluation.dataset_id}: {samples} of the records run {of} held out of its training"
    else:
        key = f"{evaluation.dataset_id}:{samples}"
        label = f"dataset {evaluation.dataset_id}, its first {samples} conversations"
    return key, label, samples


def _config_differences(runs: list[Run]) -> dict[str, dict[str, Any]]:
    """The settings (base model, datasets, each config key) whose values are not the same in all runs."""
    settings = {
        r.id: {"base_model": r.base_model, "dataset_id": r.dataset_id, "validation_dataset_id": r.validation_dataset_id}
        | r.config
        for r in runs
    }
    keys = dict.fromkeys(k for values in settings.values() for k in values)
    return {
        k: {run_id: values.get(k) for run_id, values in settings.items()}
        for k in keys
        if len({orjson.dumps(values.get(k)) for values in settings.values()}) > 1
    }


def waiting_tasks(session: Session) -> list[queue.Waiting]:
    rows = session.exec(
        select(Evaluation.id, Evaluation.pool, Evaluation.updated_at).where(
            Evaluation.status == EvaluationStatus.queued
        )
    ).all()
    return [queue.Waiting(queue.RUN_EVALUATION, pool, id_, since) for id_, pool, since in rows]


def list_evaluations(
    session: Session, owner: User, *, run_id: str | None = None, limit: int = 100, offset: int = 0
) -> list[Evaluation]:
    return owned_page(session, Evaluation, owner, limit=limit, offset=offset, run_id=run_id)


def get(session: Session, owner: User, evaluation_id: str) -> Evaluation | None:
    return owned(session, Evaluation, owner, evaluation_id)


def samples(
    session: Session, evaluation: Evaluation, *, order: str = "position", limit: int = 100, offset: int = 0
) -> tuple[list[EvaluationSample], int]:
    """A page of the evaluation's samples, in eval-set order or ``spread`` first (where the subjects'
    scores differ most), and how many there are."""
    query = select(EvaluationSample).where(EvaluationSample.evaluation_id == evaluation.id)
    if order == "spread":
        query = query.order_by(col(EvaluationSample.spread).desc(), col(EvaluationSample.position))
    else:
        query = query.order_by(col(EvaluationSample.position))
    rows = list(session.exec(query.offset(offset).limit(limit)).all())
    total = session.exec(
        select(func.count()).select_from(EvaluationSample).where(EvaluationSample.evaluation_id == evaluation.id)
    ).one()
    return rows, total


def iter_samples(session: Session, evaluation_id: str, batch: int = 500) -> Iterable[EvaluationSample]:
    """Every sample in eval-set order, a batch of rows at a time (a download of thousands)."""
    last = -1
    while True:
        rows = session.exec(
            select(EvaluationSample)
            .where(EvaluationSample.evaluation_id == evaluation_id, col(EvaluationSample.position) > last)
            .order_by(col(EvaluationSample.position))
            .limit(batch)
        ).all()
        if not rows:
            return
        yield from rows
        last = rows[-1].position


def delete(session: Session, evaluation: Evaluation) -> None:
    if evaluation.status == EvaluationStatus.running:
        raise EvaluationError("status", f"evaluation {evaluation.id} is running; cancel it first", conflict=True)
    session.exec(sql_delete(EvaluationSample).where(col(EvaluationSample.evaluation_id) == evaluation.id))
    session.delete(evaluation)
    session.commit()


def cancel(session: Session, evaluation: Evaluation) -> Evaluation:
    """A queued evaluation ends at once; a running one is flagged, and its worker stops asking at its next
    beat, stops what it serves, and ends it ``cancelled``."""
    if evaluation.status in TERMINAL:
        raise EvaluationError("status", f"evaluation {evaluation.id} is already {evaluation.status}", conflict=True)
    jobs.cancel(session, Evaluation, evaluation)
    return evaluation


# --- worker side --------------------------------------------------------------------------------


def wait_for_chips(session: Session, evaluation_id: str, why: str, retry_s: float) -> None:
    """The host that got the evaluation's task has its chips taken (``why`` says by what): the evaluation
    says so while it stays queued, and its task is sent again in ``retry_s``, to this host or another."""
    evaluation = session.get(Evaluation, evaluation_id)
    if evaluation is None or evaluation.status != EvaluationStatus.queued or evaluation.cancel_requested:
        return
    evaluation.phase, evaluation.updated_at = why, utcnow()
    session.add(evaluation)
    session.commit()
    queue.send_task(queue.RUN_EVALUATION, evaluation.id, queue=evaluation.pool, countdown=retry_s)


def start(session: Session, evaluation_id: str, worker: str) -> Evaluation | None:
    """The task takes the evaluation; None when it is not queued any more."""
    return jobs.take(session, Evaluation, evaluation_id, worker)


def checkpoint_artifact(session: Session, evaluation: Evaluation, subject: dict) -> Artifact:
    """The merged artifact of a checkpoint subject: the one already made (or being made) if any, else a new
    one, queued but with no task sent: the evaluation's worker builds it itself (a build task on the same
    pool could wait behind the evaluation for a worker slot). Were that worker lost, the heartbeat's
    re-send of lost tasks has another worker build it."""
    from app.artifacts import service as artifacts

    run = session.get_one(Run, subject["run_id"])
    made = _merge_of(session, run.id, subject["step"], exclude=ArtifactStatus.failed)
    return made or artifacts.new_merge(session, run, subject["step"])


def _merge_of(session: Session, run_id: str, step: int, *, exclude: ArtifactStatus) -> Artifact | None:
    """The newest merged artifact of the run's checkpoint at ``step`` that is not ``exclude``."""
    query = select(Artifact).where(
        Artifact.run_id == run_id,
        Artifact.kind == ArtifactKind.merged,
        Artifact.checkpoint_step == step,
        Artifact.status != exclude,
    )
    return session.exec(query.order_by(col(Artifact.created_at).desc())).first()


def promote(session: Session, owner: User, evaluation: Evaluation, data: Promotion) -> Endpoint:
    """Deploy a checkpoint subject's merge (made for the evaluation): into a ready endpoint's place when
    ``endpoint_id`` is given (``endpoints.replace``: its callers move over with no outage), else as a new
    endpoint on the evaluation's pool."""
    from app.endpoints import service as endpoints

    subject = next((s for s in evaluation.subjects if s["key"] == data.subject), None)
    if subject is None:
        keys = ", ".join(s["key"] for s in evaluation.subjects)
        raise EvaluationError("subject", f"evaluation {evaluation.id} has no subject {echo(data.subject)} ({keys})")
    if subject["kind"] != "checkpoint":
        raise EvaluationError("subject", f"{subject['label']} is a {subject['kind']}; only a checkpoint is promoted")
    # Only a merge that was built: one still building (or queued) would make the endpoint fail to start.
    artifact = _merge_of(session, subject["run_id"], subject["step"], exclude=ArtifactStatus.failed)
    if artifact is None or artifact.status != ArtifactStatus.succeeded:
        what = "is gone" if artifact is None else f"is {artifact.status}"
        raise EvaluationError("subject", f"the merge of {subject['label']} {what}: evaluate it again", conflict=True)
    try:
        if data.endpoint_id is None:
            create = EndpointCreate(artifact_id=artifact.id, pool=evaluation.pool)
            return endpoints.create(session, owner, create)
        old = endpoints.get(session, owner, data.endpoint_id)
        if old is None:
            raise EvaluationError("endpoint_id", f"endpoint {echo(data.endpoint_id)} not found", missing=True)
        return endpoints.replace(session, owner, old, artifact.id)
    except endpoints.EndpointError as exc:
        raise EvaluationError(exc.field, str(exc), conflict=exc.conflict, missing=exc.missing) from exc


def running(session: Session, evaluation_ids: list[str]) -> set[str]:
    """Those of these evaluations that are running (their subjects' model servers are theirs)."""
    query = select(Evaluation.id).where(
        col(Evaluation.id).in_(evaluation_ids), Evaluation.status == EvaluationStatus.running
    )
    return set(session.exec(query).all())


def heartbeat(session: Session, evaluation_id: str, worker: str) -> str | None:
    """Returns why the worker must stop: "cancel", "gone" (not its running evaluation any more), or None."""
    return jobs.beat(session, Evaluation, evaluation_id, worker)


def fail_stale(session: Session, pool: str) -> list[str]:
    """Fail this pool's running evaluations whose worker went silent (its samples so far stay)."""
    error = f"no heartbeat from its worker for {get_settings().stale_seconds:.0f}s: the worker was lost; run it again"
    return [e.id for e in jobs.stale(session, Evaluation, pool) if _end(session, e, EvaluationStatus.failed, error)]


def progress(
    session: Session,
    evaluation: Evaluation,
    *,
    phase: str | None = None,
    done: int | None = None,
    total: int | None = None,
    chip_s: float = 0,
) -> None:
    """What the worker is doing, replies so far (``done``), replies to get once the eval set is read
    (``total``: its conversations with a reference may be fewer than its valid rows), chip time held."""
    values: dict[str, Any] = {"updated_at": utcnow()}
    if total is not None:
        values["samples_total"] = total
    if phase is not None:
        values["phase"] = phase[:200]
    if done is not None:
        values["samples_done"] = done
    if chip_s:
        values["chip_seconds"] = col(Evaluation.chip_seconds) + chip_s
    session.exec(update(Evaluation).where(col(Evaluation.id) == evaluation.id).values(**values))
    session.commit()
    session.refresh(evaluation)


def record(session: Session, evaluation: Evaluation, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Score every sample (``position``, ``messages``, ``reference``, ``outputs`` per subject key, with
    ``perplexity`` its ``likelihoods`` per subject key ({"nll", "tokens"} of the reference), and with a
    judge its ``judgements``), store them, and the summary per subject: each metric's mean with its 95%
    bootstrap interval (``perplexity``: over all tokens; the judge's grade as metric ``judge``, with the
    count of ``unparsable`` verdicts),
    and under ``pairwise``, per pair, win/tie/loss rates of the first subject with Wilson intervals."""
    config = evaluation.config
    keys = [s["key"] for s in evaluation.subjects]
    per_subject: dict[str, dict[str, list[float]]] = {k: {m: [] for m in config["metrics"]} for k in keys}
    unparsable: dict[str, int] = {}
    outcomes: dict[str, list[str]] = {}
    samples = []
    likelihood: dict[str, tuple[list[float], list[int]]] = {k: ([], []) for k in keys}  # nll and tokens
    for row in rows:
        judgements = row.get("judgements", {})
        scores = {
            k: metrics.score(row["outputs"][k], row["reference"], config["metrics"], config.get("regex")) for k in keys
        }
        for k, scored in row.get("likelihoods", {}).items():
            scores[k]["perplexity"] = metrics.perplexity(scored["nll"], scored["tokens"])
            likelihood[k][0].append(scored["nll"])
            likelihood[k][1].append(scored["tokens"])
        for name, verdict in judgements.items():
            if "unparsable" in verdict:
                unparsable[name] = unparsable.get(name, 0) + 1
            elif name in scores:
                scores[name]["judge"] = judge_lib.normalized(verdict["score"])
            else:
                outcomes.setdefault(name, []).append(verdict["outcome"])
        for k, values in scores.items():
            for m, v in values.items():
                per_subject[k].setdefault(m, []).append(v)
        samples.append(
            EvaluationSample(
                evaluation_id=evaluation.id,
                position=row["position"],
                messages=row["messages"],
                reference=row["reference"],
                outputs=row["outputs"],
                scores=scores,
                spread=metrics.differ_most(scores),
                judgements=judgements,
            )
        )
    summary: dict[str, Any] = {}
    for k, by_metric in per_subject.items():
        summary[k] = {}
        for m, values in by_metric.items():
            if m == "perplexity" and values:  # over every token of every sample, not a mean of samples
                nll, tokens = likelihood[k]
                mean, low, high = metrics.bootstrap_perplexity(nll, tokens)
                summary[k][m] = {"mean": mean, "low": low, "high": high, "n": len(values), "tokens": sum(tokens)}
            elif values:
                mean, low, high = metrics.bootstrap_ci(values)
                summary[k][m] = {"mean": mean, "low": low, "high": high, "n": len(values)}
        if config.get("judge"):
            summary[k].setdefault("judge", {"n": 0})["unparsable"] = unparsable.get(k, 0)
    if config.get("judge") and config["judge"]["pairwise"]:
        summary["pairwise"] = {
            pair: {
                **(metrics.pairwise(outcomes[pair]) if outcomes.get(pair) else {"n": 0}),
                "unparsable": unparsable.get(pair, 0),
            }
            for pair in pairs(keys)
        }
    session.add_all(samples)
    evaluation.summary = summary
    evaluation.updated_at = utcnow()
    session.add(evaluation)
    session.commit()
    return summary


def pairs(keys: list[str]) -> list[str]:
    """The pairs a pairwise judge compares: the first subject with each other one ("s0:s1", ...)."""
    return [f"{keys[0]}:{k}" for k in keys[1:]]


def finish(session: Session, evaluation: Evaluation) -> None:
    _end(session, evaluation, EvaluationStatus.succeeded, None)


def cancelled(session: Session, evaluation: Evaluation) -> None:
    _end(session, evaluation, EvaluationStatus.cancelled, None)


def fail(session: Session, evaluation: Evaluation, error: str) -> None:
    _end(session, evaluation, EvaluationStatus.failed, error[:2000])


def _end(session: Session, evaluation: Evaluation, status: EvaluationStatus, error: str | None) -> bool:
    return jobs.end(session, Evaluation, evaluation, status, error, phase=None)
