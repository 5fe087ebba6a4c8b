"""Every table, imported in one place so that migrations see the whole schema."""

from app.arena.models import Battle
from app.artifacts.models import Artifact
from app.auth.models import ApiToken, LoginFailure, User
from app.base_models.models import RegisteredModel
from app.benchmarks.models import Benchmark
from app.datasets.models import Dataset
from app.endpoints.models import Endpoint, EndpointSample
from app.evaluations.models import Evaluation, EvaluationSample
from app.pools.models import Pool, WorkerHost
from app.runs.models import Run, RunCheckpoint, RunEvent, RunMetric

__all__ = [
    "ApiToken",
    "Battle",
    "Artifact",
    "Benchmark",
    "Dataset",
    "Endpoint",
    "EndpointSample",
    "Evaluation",
    "EvaluationSample",
    "LoginFailure",
    "Pool",
    "RegisteredModel",
    "Run",
    "RunCheckpoint",
    "RunEvent",
    "RunMetric",
    "User",
    "WorkerHost",
]
