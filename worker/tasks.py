"""Every task a worker runs. Each opens its own DB session and calls a service; nothing more."""

from app.core import queue
from app.core.db import session_scope
from app.datasets import service as datasets
from worker import artifacts, benchmarks, endpoints, evaluations, runs
from worker.celery_app import celery
from worker.model_cache import local_dataset


# A pool process that dies mid-validation (killed: out of memory) has its task sent again at once, as a
# new message rather than the old one put back (kombu's SQLite broker can lose that one: it puts it back
# from another thread, on the session the consumer is using). datasets.service.validate counts the
# attempts and gives up after a few, so Celery does not limit the retries.
@celery.task(name=queue.VALIDATE_DATASET, retry_on_worker_lost=True, default_retry_delay=0, max_retries=None)
def validate_dataset(dataset_id: str) -> None:
    with session_scope() as session:
        datasets.validate(session, dataset_id, local_dataset)  # its file, copied here if uploaded elsewhere


@celery.task(name=queue.TRAIN_RUN, bind=True)
def train_run(self, run_id: str) -> None:
    runs.execute(run_id, self.request.hostname)


@celery.task(name=queue.TRAIN_ON_HOST, bind=True)
def train_on_host(self, run_id: str, attempt: int, host_index: int) -> None:
    runs.execute_on_host(run_id, attempt, host_index, self.request.hostname)


@celery.task(name=queue.BUILD_ARTIFACT, bind=True)
def build_artifact(self, artifact_id: str) -> None:
    artifacts.execute(artifact_id, self.request.hostname)


@celery.task(name=queue.START_ENDPOINT, bind=True)
def start_endpoint(self, endpoint_id: str) -> None:
    endpoints.launch(endpoint_id, self.request.hostname)


@celery.task(name=queue.RUN_BENCHMARK, bind=True)
def run_benchmark(self, benchmark_id: str) -> None:
    benchmarks.execute(benchmark_id, self.request.hostname)


@celery.task(name=queue.RUN_EVALUATION, bind=True)
def run_evaluation(self, evaluation_id: str) -> None:
    evaluations.execute(evaluation_id, self.request.hostname)
