"""Benchmarks of endpoints: the state machine (queued -> running -> succeeded | failed | cancelled),
advanced by the `tunedeck.benchmarks.run` task on the endpoint's pool (worker/benchmarks.py), which
sends the load from the endpoint's host, beats the benchmark's heartbeat, and records each level here
as it completes. A benchmark whose worker went silent is failed by the pool's workers (``fail_stale``,
from their heartbeat thread); the user cancels one with ``cancel``."""

from __future__ import annotations

from sqlmodel import Session, select

from app.auth.models import User
from app.benchmarks.models import TERMINAL, Benchmark, BenchmarkCreate, BenchmarkPublic, BenchmarkStatus
from app.core import jobs, queue
from app.core.config import get_settings
from app.core.db import owned, owned_page, utcnow
from app.core.echo import echo
from app.core.errors import FieldError
from app.core.security import new_id
from app.datasets.models import Dataset, DatasetStatus
from app.endpoints.models import Endpoint, EndpointCreate, EndpointStatus
from app.pools.models import Pool

# The most tokens one benchmark may ask its endpoint to process, over all its levels: levels x
# num_prompts x (input_len + output_len). 2**23 (8.4M) holds `vllm bench serve`'s default random load
# (1000 prompts of 1024 + 128 tokens) at 7 levels. An endpoint that generates 4000 tokens/s gets through
# it in 35 minutes even if every token were an output token (prompt tokens cost far less), so no
# benchmark keeps an endpoint busy for hours, and the prompts a worker makes and holds for a level
# (input_len x num_prompts tokens of text) stay tens of MB at most.
MAX_TOKENS = 2**23
# What the model server is started with when the endpoint's settings do not say (the built-in
# server's default, and EndpointCreate's).
DEFAULT_MAX_MODEL_LEN = EndpointCreate.model_fields["max_model_len"].default


class BenchmarkError(FieldError):
    pass


def to_public(benchmark: Benchmark) -> BenchmarkPublic:
    return BenchmarkPublic.model_validate(benchmark)


def create(session: Session, owner: User, data: BenchmarkCreate) -> Benchmark:
    endpoint = session.get(Endpoint, data.endpoint_id)
    if endpoint is None or endpoint.owner_id != owner.id:
        raise BenchmarkError("endpoint_id", f"unknown endpoint {echo(data.endpoint_id)}")
    if endpoint.status != EndpointStatus.ready:
        raise BenchmarkError("endpoint_id", f"endpoint {endpoint.id} is {endpoint.status}; benchmark a ready one")
    if data.dataset_id is not None:
        dataset = session.get(Dataset, data.dataset_id)
        if dataset is None or dataset.owner_id != owner.id:
            raise BenchmarkError("dataset_id", f"unknown dataset {echo(data.dataset_id)}")
        if dataset.status != DatasetStatus.ready or not dataset.valid_rows:
            raise BenchmarkError("dataset_id", f"dataset {dataset.id} is {dataset.status}; its prompts cannot be used")
    levels = len(data.concurrency) + len(data.request_rates)
    check_size(data, endpoint, levels)
    queue.check_broker()
    pool = session.get(Pool, endpoint.pool)
    config = data.model_dump(exclude={"endpoint_id"})
    assert owner.id is not None, "the owner is a saved user"
    benchmark = Benchmark(
        id=new_id("bm"),
        owner_id=owner.id,
        endpoint_id=endpoint.id,
        model=endpoint.model,
        pool=endpoint.pool,
        runtime=endpoint.runtime,
        chips=pool.chips if pool else 1,
        price_per_chip_hour=pool.price_per_chip_hour if pool else 0.0,
        config=config,
        requests_total=levels * data.num_prompts,
    )
    session.add(benchmark)
    session.commit()
    queue.send_task(queue.RUN_BENCHMARK, benchmark.id, queue=endpoint.pool)
    return benchmark


def waiting_tasks(session: Session) -> list[queue.Waiting]:
    """Benchmarks that wait for a worker of their endpoint's pool."""
    rows = session.exec(
        select(Benchmark.id, Benchmark.pool, Benchmark.updated_at).where(Benchmark.status == BenchmarkStatus.queued)
    ).all()
    return [queue.Waiting(queue.RUN_BENCHMARK, pool, id_, since) for id_, pool, since in rows]


def check_size(data: BenchmarkCreate, endpoint: Endpoint, levels: int) -> None:
    """Each request must fit the endpoint's context (its ``max_model_len``: prompt + reply tokens), and
    the whole benchmark the ``MAX_TOKENS`` bound. A dataset's prompts are as long as its conversations
    (``input_len`` is not used): their reply must leave room for one, and only replies are counted."""
    context = int(endpoint.settings.get("max_model_len") or DEFAULT_MAX_MODEL_LEN)
    where = f"endpoint {endpoint.id}'s max_model_len {context}"
    if data.dataset_id is not None:
        if data.output_len >= context:
            raise BenchmarkError("output_len", f"output_len {data.output_len} leaves no room for a prompt in {where}")
        per_request = data.output_len
    else:
        if data.input_len >= context:
            raise BenchmarkError(
                "input_len", f"input_len {data.input_len} leaves no room for a reply in {where} (prompt + reply tokens)"
            )
        if data.input_len + data.output_len > context:
            raise BenchmarkError(
                "output_len",
                f"input_len + output_len = {data.input_len + data.output_len} tokens do not fit {where}: "
                f"at most {context - data.input_len} output tokens with input_len {data.input_len}",
            )
        per_request = data.input_len + data.output_len
    total = levels * data.num_prompts * per_request
    if total > MAX_TOKENS:
        counted = "output_len" if data.dataset_id is not None else "(input_len + output_len)"
        raise BenchmarkError(
            "num_prompts",
            f"{levels} levels x {data.num_prompts} num_prompts x {per_request} tokens {counted} = {total} tokens; "
            f"a benchmark asks at most {MAX_TOKENS} (fewer requests, levels or tokens per request)",
        )


def list_benchmarks(
    session: Session, owner: User, *, endpoint_id: str | None = None, limit: int = 100, offset: int = 0
) -> list[Benchmark]:
    return owned_page(session, Benchmark, owner, limit=limit, offset=offset, endpoint_id=endpoint_id)


def get(session: Session, owner: User, benchmark_id: str) -> Benchmark | None:
    return owned(session, Benchmark, owner, benchmark_id)


def delete(session: Session, benchmark: Benchmark) -> None:
    if benchmark.status == BenchmarkStatus.running:
        raise BenchmarkError("status", f"benchmark {benchmark.id} is running; cancel it first", conflict=True)
    session.delete(benchmark)
    session.commit()


def cancel(session: Session, benchmark: Benchmark) -> Benchmark:
    """Cancel a queued or running benchmark. A queued one ends at once (its task, when it comes, finds it
    cancelled); a running one is flagged, and its worker stops the load at its next heartbeat and ends it
    ``cancelled``. The flag is set in both cases: a worker that takes a queued one meanwhile sees it too."""
    if benchmark.status in TERMINAL:
        raise BenchmarkError("status", f"benchmark {benchmark.id} is already {benchmark.status}", conflict=True)
    jobs.cancel(session, Benchmark, benchmark)
    return benchmark


# --- worker side --------------------------------------------------------------------------------


def start(session: Session, benchmark_id: str, worker: str) -> Benchmark | None:
    """The task takes the benchmark; None when it is not queued any more (cancelled, or taken by an
    earlier delivery of the task). It fails at once when its endpoint is no longer ready."""
    benchmark = jobs.take(session, Benchmark, benchmark_id, worker)
    if benchmark is None:
        return None
    endpoint = session.get(Endpoint, benchmark.endpoint_id) if benchmark.endpoint_id else None
    if endpoint is None or endpoint.status != EndpointStatus.ready:
        state = endpoint.status if endpoint else "deleted"
        fail(session, benchmark, f"endpoint {benchmark.endpoint_id} is {state}")
        return None
    return benchmark


def heartbeat(session: Session, benchmark_id: str, worker: str) -> str | None:
    """The worker sending the load is alive. Returns why it must stop: "cancel" (the user cancelled the
    benchmark), "gone" (it is not this worker's running benchmark any more: deleted, or failed by the
    stale sweep while this worker was silent), or None to go on."""
    return jobs.beat(session, Benchmark, benchmark_id, worker)


def fail_stale(session: Session, pool: str) -> list[str]:
    """Fail this pool's running benchmarks whose worker went silent (killed, or its host lost). Failed, not
    re-queued: a benchmark is cheap to run again, the levels measured so far would be mixed with a second
    attempt's, and the host that sent the load is most often the endpoint's own, lost with it."""
    settings = get_settings()
    ended = []
    for benchmark in jobs.stale(session, Benchmark, pool):
        error = (
            f"no heartbeat from {benchmark.worker or 'its worker'} for {settings.stale_seconds:.0f}s: "
            "the worker sending its load was lost; run it again"
        )
        if _end(session, benchmark, BenchmarkStatus.failed, error):
            ended.append(benchmark.id)
    return ended


def progress(session: Session, benchmark: Benchmark, requests_done: int) -> None:
    benchmark.requests_done = requests_done
    benchmark.updated_at = utcnow()
    session.add(benchmark)
    session.commit()


def add_level(session: Session, benchmark: Benchmark, level: dict) -> None:
    """A level's results, with their cost: the pool's chip-hours per million output tokens at the
    level's output throughput."""
    rate = level["output_throughput"]
    usd = benchmark.chips * benchmark.price_per_chip_hour / (rate * 3600) * 1e6 if rate > 0 else None
    benchmark.results = [*benchmark.results, {**level, "usd_per_million_output_tokens": usd}]
    benchmark.updated_at = utcnow()
    session.add(benchmark)
    session.commit()


def finish(session: Session, benchmark: Benchmark) -> None:
    _end(session, benchmark, BenchmarkStatus.succeeded, None)


def cancelled(session: Session, benchmark: Benchmark) -> None:
    """The worker stopped the load of a cancelled benchmark; the levels it finished stay."""
    _end(session, benchmark, BenchmarkStatus.cancelled, None)


def fail(session: Session, benchmark: Benchmark, error: str) -> None:
    _end(session, benchmark, BenchmarkStatus.failed, error[:2000])


def _end(session: Session, benchmark: Benchmark, status: BenchmarkStatus, error: str | None) -> bool:
    """End a running benchmark; False (nothing changed) when it had ended already, e.g. a worker that was
    silent too long and was failed by the stale sweep must not write over that."""
    return jobs.end(session, Benchmark, benchmark, status, error)
