"""An evaluation: one or more subjects (a run checkpoint, a ready endpoint, a base model) answer the
prompts of an eval set, and each answer is scored against the set's reference (its last assistant
message) with the metrics of `app/evaluations/metrics.py`. Its samples are kept a row each, so they can
be browsed, sorted by where the subjects differ most, and downloaded."""

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import SecretStr, field_validator, model_validator
from sqlalchemy import JSON, Column, Index, UniqueConstraint
from sqlmodel import AutoString, Field, SQLModel

from app.core.db import utcnow
from app.core.schemas import ID_LENGTH, INT32_MAX, NAME_LENGTH, Schema
from app.evaluations.metrics import METRICS

MAX_SUBJECTS = 16


class EvaluationStatus(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"  # a subject could not be served or answered, or its worker went silent (error says why)
    cancelled = "cancelled"


TERMINAL = {EvaluationStatus.succeeded, EvaluationStatus.failed, EvaluationStatus.cancelled}


class Subject(Schema):
    """What answers: ``checkpoint`` (a run's checkpoint at ``step``, its last when not given: merged, then
    served for the evaluation on the run's pool and stopped after), ``checkpoints`` (every checkpoint the
    run has, in step order: a checkpoint sweep, which the run page charts against the step), ``endpoint``
    (a ready endpoint, as it is) or ``base`` (the base model of ``run_id``, or the registered base model
    ``base_model``, served for the evaluation)."""

    kind: Literal["checkpoint", "checkpoints", "endpoint", "base"]
    run_id: str | None = Field(default=None, max_length=ID_LENGTH)
    step: int | None = Field(default=None, ge=0, le=INT32_MAX)
    endpoint_id: str | None = Field(default=None, max_length=ID_LENGTH)
    base_model: str | None = Field(default=None, max_length=NAME_LENGTH)

    @model_validator(mode="after")
    def _fields_of_kind(self):
        need = {"checkpoint": "run_id", "checkpoints": "run_id", "endpoint": "endpoint_id"}.get(self.kind)
        if need and getattr(self, need) is None:
            raise ValueError(f"a {self.kind} subject names its {need}")
        if self.kind == "checkpoints" and self.step is not None:
            raise ValueError("a checkpoints subject is every checkpoint of the run: leave step out")
        if self.kind == "base" and (self.run_id is None) == (self.base_model is None):
            raise ValueError("a base subject names either run_id (that run's base model) or base_model")
        return self


class JudgeConfig(Schema):
    """An LLM judge: a ready endpoint of yours (``endpoint_id``), or any OpenAI-compatible server (``url``,
    its base URL as OpenAI's SDK takes it, e.g. ``https://api.openai.com/v1``, with ``model`` and an
    ``api_key``, kept sealed and never shown again). It grades each subject's answers with a built-in
    ``rubric`` or a ``prompt`` of your own (``{question}``, ``{reference}``, ``{answer}``, ``{system}`` are
    filled in), and with ``pairwise``, compares the first subject with each other one, in both orders."""

    endpoint_id: str | None = Field(default=None, max_length=ID_LENGTH)
    url: str | None = Field(default=None, max_length=2000)
    model: str | None = Field(default=None, max_length=NAME_LENGTH)
    api_key: SecretStr | None = Field(default=None, max_length=4000)
    rubric: str | None = Field(default="correctness", max_length=64)
    prompt: str | None = Field(default=None, max_length=20_000)
    pairwise: bool = False
    max_tokens: int = Field(default=256, ge=16, le=4096, description="tokens per verdict at most")

    @model_validator(mode="after")
    def _one_judge(self):
        if (self.endpoint_id is None) == (self.url is None):
            raise ValueError("a judge is either an endpoint of yours (endpoint_id) or a server (url)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError("a judge's url starts with http:// or https://")
        if self.url is not None and not self.model:
            raise ValueError("a judge at a url names the model to ask there")
        if self.endpoint_id is not None and (self.model or self.api_key):
            raise ValueError("an endpoint judge is asked with its own model and key: leave model and api_key out")
        from app.evaluations.judge import check_rubric

        check_rubric(self.rubric, self.prompt)
        return self


class EvaluationConfig(Schema):
    """How the subjects are asked and scored. Replies are greedy (temperature 0), so a score is a property
    of the model and not of a draw."""

    metrics: list[str] = Field(default=["exact_match", "chrf"], description=f"any of {sorted(METRICS)}")
    regex: str | None = Field(
        default=None,
        max_length=500,
        description="regex_match's pattern: the answer is its first match (group 1 if it has one)",
    )
    max_samples: int = Field(default=200, ge=1, le=10_000, description="the eval set's first N conversations")
    max_tokens: int = Field(default=128, ge=1, le=8192, description="tokens per reply at most")
    concurrency: int = Field(default=8, ge=1, le=256, description="requests in flight per subject")
    judge: JudgeConfig | None = None

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, v: list[str]) -> list[str]:
        unknown = [m for m in v if m not in METRICS]
        if unknown:
            raise ValueError(f"unknown metric {unknown[0]!r}: choose from {sorted(METRICS)}")
        if not v:
            raise ValueError("name at least one metric")
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _pattern(self):
        if "regex_match" in self.metrics and not self.regex:
            raise ValueError("regex_match needs a regex")
        if self.regex is not None:
            from app.evaluations.metrics import compile_pattern

            compile_pattern(self.regex)  # ValueError names what is wrong with it
        return self


class EvaluationCreate(EvaluationConfig):
    subjects: list[Subject] = Field(min_length=1, max_length=MAX_SUBJECTS)
    dataset_id: str | None = Field(
        default=None, max_length=ID_LENGTH, description="the eval set: a chat dataset of this user's"
    )
    validation_of: str | None = Field(
        default=None,
        max_length=ID_LENGTH,
        description="or a run of this user's: the eval set is its validation split (the records its "
        "validation_fraction held out of training, or its validation dataset)",
    )

    @model_validator(mode="after")
    def _one_eval_set(self):
        if (self.dataset_id is None) == (self.validation_of is None):
            raise ValueError("name the eval set: a dataset (dataset_id) or a run's validation split (validation_of)")
        return self


class Promotion(Schema):
    """Deploy a checkpoint subject: into the place of a ready endpoint of yours (``endpoint_id``: it
    keeps its model name, and its callers move over once the new one is ready), or as a new endpoint."""

    subject: str = Field(max_length=8, description='the subject\'s key ("s0", "s1", ...)')
    endpoint_id: str | None = Field(default=None, max_length=ID_LENGTH)


class Evaluation(SQLModel, table=True):
    __tablename__ = "evaluations"  # pyright: ignore[reportAssignmentType]
    __table_args__ = (Index("ix_evaluations_owner_created", "owner_id", "created_at", "id"),)
    id: str = Field(primary_key=True, max_length=32)
    owner_id: int = Field(foreign_key="users.id", ondelete="CASCADE")
    dataset_id: str | None = Field(
        default=None, foreign_key="datasets.id", ondelete="SET NULL", index=True, max_length=32
    )
    # The runs it evaluates, for the run page (the first checkpoint or base subject's run, if any).
    run_id: str | None = Field(default=None, foreign_key="runs.id", ondelete="SET NULL", index=True, max_length=32)
    pool: str = Field(max_length=64)  # where the subjects are served and asked
    chips: int
    price_per_chip_hour: float
    status: EvaluationStatus = Field(default=EvaluationStatus.queued, index=True, sa_type=AutoString(16))
    # Each subject as asked, with ``key`` ("s0", "s1", ...: its column in the samples) and ``label``.
    subjects: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    config: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    # Per subject key: per metric {mean, low, high, n} (95% bootstrap interval of the mean).
    summary: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    samples_total: int = 0  # samples x subjects: the replies to get
    samples_done: int = 0
    chip_seconds: float = 0.0  # the pool's chips held while subjects were served for it
    phase: str | None = Field(default=None, max_length=200)  # what the worker is doing ("serving s1", ...)
    error: str | None = None
    attempts: int = 0
    worker: str | None = Field(default=None, max_length=255)
    heartbeat_at: datetime | None = None
    cancel_requested: bool = False
    judge_key: str | None = None  # the judge's API key, sealed (app.core.security.seal); never shown
    created_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    updated_at: datetime = Field(default_factory=utcnow)


class EvaluationSample(SQLModel, table=True):
    """One prompt of the eval set, with every subject's reply and scores."""

    __tablename__ = "evaluation_samples"  # pyright: ignore[reportAssignmentType]
    __table_args__ = (UniqueConstraint("evaluation_id", "position"),)
    id: int | None = Field(default=None, primary_key=True)
    evaluation_id: str = Field(foreign_key="evaluations.id", ondelete="CASCADE", index=True, max_length=32)
    position: int  # its place in the eval set (0-based, over the conversations that have a reference)
    messages: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    reference: str
    outputs: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    scores: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    spread: float = 0.0  # the largest difference between two subjects' scores of one metric
    # The judge's verdicts: per subject key {"score", "reason"} or {"unparsable": its reply}; per pair
    # ("s0:s1") {"orders": [verdict A first, verdict B first], "outcome", "reasons"} or {"unparsable": ...}.
    judgements: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))


class EvaluationPublic(SQLModel):
    id: str
    dataset_id: str | None
    run_id: str | None
    pool: str
    chips: int
    price_per_chip_hour: float
    status: EvaluationStatus
    subjects: list[dict[str, Any]]
    config: dict[str, Any]
    summary: dict[str, Any]
    samples_total: int
    samples_done: int
    chip_seconds: float
    cost_usd: float
    phase: str | None
    error: str | None
    cancel_requested: bool
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class EvaluationsPublic(SQLModel):
    data: list[EvaluationPublic]
    count: int


class EvaluationSamplePublic(SQLModel):
    position: int
    messages: list[dict[str, Any]]
    reference: str
    outputs: dict[str, Any]
    scores: dict[str, Any]
    spread: float
    judgements: dict[str, Any]


class EvaluationSamplesPublic(SQLModel):
    data: list[EvaluationSamplePublic]
    count: int


class ComparedRow(SQLModel):
    """One subject's scores on an eval set: a run's checkpoint (``run_id``, ``step``) or a base model."""

    kind: str
    label: str
    run_id: str | None
    step: int | None
    base_model: str | None
    evaluation_id: str
    scores: dict[str, Any]  # metric -> {mean, low, high, n}, as in an evaluation's summary
    chip_seconds: float  # the whole evaluation's (its subjects were served one after another)
    cost_usd: float
    finished_at: datetime | None


class EvalSetComparison(SQLModel):
    """The subjects of the compared runs that were asked one eval set, the newest evaluation of each, with
    the run settings that differ between those runs (``config_differences``: key -> run id -> value)."""

    eval_set: str  # the same key for the same records: dataset, held-out lines, sample count
    label: str
    dataset_id: str | None
    samples: int
    metrics: list[str]
    rows: list[ComparedRow]
    config_differences: dict[str, dict[str, Any]]


class EvaluationComparison(SQLModel):
    run_ids: list[str]
    data: list[EvalSetComparison]
    count: int
