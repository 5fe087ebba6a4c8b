"""Running a benchmark (the `tunedeck.benchmarks.run` task, on the endpoint's pool): load sent straight
to the endpoint's model server from its host, level by level, measured as `vllm bench serve` measures:

- TTFT: request sent -> the first streamed chunk with choices, text or not; ITL: the gaps between
  such chunks (``measure`` has vLLM's request functions' exact rules);
- TPOT: (E2E - TTFT) / (output tokens - 1) per request; E2E latency: sent -> last chunk;
- request and output-token throughput: completed requests and output tokens / the level's duration;
  goodput: completed requests within the SLOs given (``goodput``) per second;
- mean, median, standard deviation, and the ``metric_percentiles`` of the ``percentile_metrics``
  (``--percentile-metrics``, ``--metric-percentiles``: by default the p99 of TTFT, TPOT and ITL).

Its client is aiohttp's, as vLLM's: at 16 streams and more, httpx's own time per chunk adds
milliseconds to what the client sees.

Requests carry the model server's key, as the gateway's do.

Prompts are random token ids of ``input_len`` decoded with the model's own tokenizer (vLLM's random
dataset), or a dataset's conversations up to their last reply (sent as chat). Replies go on to
``output_len`` tokens (``ignore_eos``). In ``rate`` mode requests arrive as a Poisson process.

While the load runs, a thread beats the benchmark's heartbeat (``worker.beat.Beat``): a worker that goes silent has
its benchmark failed by the pool's other workers (``benchmarks.fail_stale``). The same beat reads the
user's cancel: the level in flight is dropped, its requests closed (the model server stops decoding
them), and the benchmark ends ``cancelled`` with the levels it finished.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable

import aiohttp
import numpy as np
import orjson
from sqlmodel import Session

from app.artifacts import service as artifacts
from app.artifacts.models import Artifact
from app.benchmarks import service as benchmarks
from app.core.db import session_scope
from app.datasets.models import Dataset
from app.datasets.validation import iter_conversations
from app.endpoints.models import Endpoint
from worker.beat import Beat
from worker.model_cache import local_artifact, local_dataset
from worker.probe import auth

PROGRESS_EVERY_S = 0.5
STOP_POLL_S = 0.1  # how soon the load stops once it is seen
MAX_ERRORS = 3
DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl")  # vllm bench serve's --percentile-metrics default

log = logging.getLogger(__name__)


class Stopped(Exception):  # noqa: N818 - not an error: the load was told to stop
    """``run_level``'s ``stop`` was set: the level's requests were closed before all were answered."""


def execute(benchmark_id: str, worker: str) -> None:
    with session_scope() as session:
        benchmark = benchmarks.start(session, benchmark_id, worker)
        if benchmark is None:
            return
        with Beat(benchmarks.heartbeat, benchmark_id, worker) as beat:
            try:
                _run(session, benchmark, beat.stop)
            except Stopped:
                if beat.reason == "cancel":
                    benchmarks.cancelled(session, benchmark)
                else:  # ended elsewhere (failed by the stale sweep, or deleted): nothing more to write
                    log.warning("benchmark %s is no longer this worker's: its load stopped", benchmark_id)
            except Exception as exc:
                benchmarks.fail(session, benchmark, f"{type(exc).__name__}: {exc}")
                raise


def _run(session, benchmark, stop: threading.Event) -> None:
    """Every level, in order, then ``succeeded``; ``Stopped`` as soon as ``stop`` is set (the level in
    flight is dropped: a part of a level is not comparable)."""
    config = benchmark.config
    endpoint = session.get(Endpoint, benchmark.endpoint_id)
    if endpoint is None or endpoint.url is None:  # `start` found it ready; stopped since?
        raise RuntimeError(f"endpoint {benchmark.endpoint_id} is no longer ready")
    prompts = _prompts(session, endpoint, config)
    done = 0
    last = 0.0

    def progress(n: int) -> None:
        nonlocal last
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            benchmarks.progress(session, benchmark, done + n)

    levels = [("concurrency", c) for c in config["concurrency"]]
    levels += [("request_rate", r) for r in config["request_rates"]]
    for kind, value in levels:
        if stop.is_set():
            raise Stopped
        level = asyncio.run(
            run_level(
                endpoint.url,
                endpoint.model,
                prompts,
                output_len=config["output_len"],
                concurrency=value if kind == "concurrency" else config["max_concurrency"],
                request_rate=value if kind == "request_rate" else None,
                seed=config["seed"],
                on_request=progress,
                stop=stop,
                headers=auth(endpoint.api_key),
                percentile_metrics=tuple(config.get("percentile_metrics", DEFAULT_PERCENTILE_METRICS)),
                metric_percentiles=tuple(config.get("metric_percentiles", (99.0,))),
                goodput=config.get("goodput"),
            )
        )
        done += len(prompts)
        benchmarks.progress(session, benchmark, done)
        benchmarks.add_level(session, benchmark, level)
    benchmarks.finish(session, benchmark)


def _prompts(session: Session, endpoint: Endpoint, config: dict) -> list[dict]:
    """``num_prompts`` request bodies (without model and sampling): completions of random prompts, or
    chats from the dataset's conversations (cycled when it has fewer)."""
    n = config["num_prompts"]
    if config["dataset_id"]:
        dataset = session.get(Dataset, config["dataset_id"])
        if dataset is None:  # deleted while the benchmark waited for a worker
            raise ValueError(f"dataset {config['dataset_id']} no longer exists")
        chats = []
        path = local_dataset(dataset, log.info)
        for messages in iter_conversations(path, dataset.filename, file_type=dataset.file_type, fmt=dataset.format):
            turns = [m for m in messages if m["role"] in ("system", "user", "assistant")]
            while turns and turns[-1]["role"] == "assistant":
                turns.pop()
            if turns:
                chats.append({"messages": turns})
            if len(chats) >= n:
                break
        if not chats:
            raise ValueError(f"dataset {dataset.id} has no conversations with a user turn")
        return list(itertools.islice(itertools.cycle(chats), n))
    from tokenizers import Tokenizer

    artifact = session.get_one(Artifact, endpoint.artifact_id)  # deleting it deletes its endpoints
    directory = local_artifact(artifact, lambda: artifacts.served(session), log=log.info)  # here when it is served
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    special = set(tokenizer.get_added_tokens_decoder())
    vocab = [i for i in range(tokenizer.get_vocab_size()) if i not in special]
    rng = random.Random(config["seed"])
    return [{"prompt": tokenizer.decode(rng.choices(vocab, k=config["input_len"]))} for _ in range(n)]


async def run_level(
    url: str,
    model: str,
    prompts: list[dict],
    *,
    output_len: int,
    concurrency: int | None = None,
    request_rate: float | None = None,
    seed: int = 0,
    on_request: Callable[[int], None] | None = None,
    headers: dict[str, str] | None = None,
    stop: threading.Event | None = None,
    percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS,
    metric_percentiles: tuple[float, ...] = (99.0,),
    goodput: dict[str, float] | None = None,
) -> dict:
    """Send every prompt once, at most ``concurrency`` in flight, arriving at ``request_rate`` per
    second (Poisson) when given, else all at once; the level's results. When ``stop`` is set, no more
    requests are sent, those in flight are closed, and ``Stopped`` is raised."""
    gate = asyncio.Semaphore(concurrency or len(prompts))
    rng = random.Random(seed)
    finished = 0
    timeout = aiohttp.ClientTimeout(total=None, connect=30)
    connector = aiohttp.TCPConnector(limit=0)  # no cap: the gate decides how many are in flight
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as client:

        async def one(body: dict) -> dict:
            nonlocal finished
            async with gate:
                result = await _request(client, url, model, body, output_len)
            finished += 1
            if on_request is not None:
                on_request(finished)
            return result

        tasks: list[asyncio.Task] = []

        async def send() -> list[dict]:
            for body in prompts:
                if request_rate is not None and tasks:
                    await asyncio.sleep(rng.expovariate(request_rate))
                tasks.append(asyncio.create_task(one(body)))
            return await asyncio.gather(*tasks)

        started = time.perf_counter()
        sending = asyncio.create_task(send())
        while stop is not None and not sending.done():
            if stop.is_set():
                for task in (sending, *tasks):
                    task.cancel()
                await asyncio.gather(sending, *tasks, return_exceptions=True)  # their connections closed
                raise Stopped
            await asyncio.wait({sending}, timeout=STOP_POLL_S)
        results = await sending
        duration = time.perf_counter() - started
    return summarize(
        results,
        duration,
        concurrency=None if request_rate else concurrency,
        request_rate=request_rate,
        percentile_metrics=percentile_metrics,
        metric_percentiles=metric_percentiles,
        goodput=goodput,
    )


async def _request(client: aiohttp.ClientSession, url: str, model: str, body: dict, output_len: int) -> dict:
    chat = "messages" in body
    payload = {
        **body,
        "model": model,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events: list[tuple[float, dict]] = []  # each data message but [DONE], with when it came
    path = "chat/completions" if chat else "completions"
    sent = time.perf_counter()
    try:
        async with client.post(f"{url}/v1/{path}", json=payload) as r:
            if r.status != 200:
                text = (await r.read()).decode(errors="replace")
                return {"error": f"HTTP {r.status}: {text[:200]}"}
            async for line in r.content:
                if not line.startswith(b"data:"):
                    continue  # blank separators, SSE comments and other fields
                data = line[5:].strip()
                if data != b"[DONE]":
                    events.append((time.perf_counter(), orjson.loads(data)))
    except aiohttp.ClientError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return measure(sent, events, chat=chat)


def measure(sent: float, events: list[tuple[float, dict]], *, chat: bool) -> dict:
    """One request's figures from its streamed messages ``(arrival, parsed JSON)``, as vLLM's request
    functions (``vllm/benchmarks/lib/endpoint_request_func.py``) take them:

    - every message with a non-empty ``choices`` counts, text or not (a chat's first chunk carries only
      the role; a special token's chunk has empty text): the first gives TTFT, each later one an ITL gap
      from the message before;
    - the latency (E2E) runs to the last message with choices for completions, and to the last message
      of any kind (the usage chunk included) for chat;
    - a completion with no message with choices failed; a chat that had none is still counted, with a
      TTFT of 0 (vLLM's chat function does the same);
    - output tokens: ``usage.completion_tokens``. Both servers send usage here (``include_usage``);
      where one does not, vLLM's client tokenizes the reply, and this counts its messages with choices.
    """
    ttft: float | None = None
    itl: list[float] = []
    recent = sent
    chunks = 0
    output = 0
    for at, message in events:
        if message.get("choices"):
            chunks += 1
            if ttft is None:
                ttft = at - sent
            else:
                itl.append(at - recent)
            if not chat:
                recent = at
        elif usage := message.get("usage"):
            output = usage.get("completion_tokens") or 0
        if chat:
            recent = at
    if ttft is None:
        if not chat:
            return {"error": "never received a chunk with choices (no TTFT)"}
        ttft = 0.0
    output = output or chunks
    e2el = recent - sent
    usage_in = next((m["usage"].get("prompt_tokens") or 0 for _, m in reversed(events) if m.get("usage")), 0)
    return {
        "ttft": ttft,
        "e2el": e2el,
        "itl": itl,
        "tpot": (e2el - ttft) / (output - 1) if output > 1 else None,
        "input_tokens": usage_in,
        "output_tokens": output,
    }


def _stat(values: list[float], percentiles: list[float] | None) -> dict:
    """Mean, median and standard deviation (ms), and the ``percentiles`` (numpy's linear interpolation,
    keyed as vLLM's result keys them: ``p99``, ``p99.9``); None where there are no values. No
    percentiles where the metric is not one of the level's ``percentile_metrics``."""
    if not values:
        return {"mean": None, "median": None, "std": None, "percentiles": {}}
    ms = np.asarray(values, dtype=np.float64) * 1000
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "std": float(ms.std()),
        "percentiles": {percentile_key(p): float(np.percentile(ms, p)) for p in percentiles or []},
    }


def percentile_key(p: float) -> str:
    return "p" + (str(int(p)) if int(p) == p else str(p))


def summarize(
    results: list[dict],
    duration: float,
    *,
    concurrency: int | None,
    request_rate: float | None,
    percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS,
    metric_percentiles: tuple[float, ...] = (99.0,),
    goodput: dict[str, float] | None = None,
) -> dict:
    """The level's figures over its requests, as vLLM's ``calculate_metrics`` makes them: TPOT over the
    requests with more than one output token; ITL over every gap of every request; goodput: completed
    requests within every SLO (``goodput``: ms for ``ttft``, ``tpot``, ``e2el``; a request of one token
    has a TPOT of 0 there) per second."""
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    input_tokens = sum(r["input_tokens"] for r in ok)
    output_tokens = sum(r["output_tokens"] for r in ok)
    values = {
        "ttft": [r["ttft"] for r in ok],
        "tpot": [r["tpot"] for r in ok if r["tpot"] is not None],
        "itl": [gap for r in ok for gap in r["itl"]],
        "e2el": [r["e2el"] for r in ok],
    }
    good = None
    if goodput:
        per_request = {"ttft": lambda r: r["ttft"], "tpot": lambda r: r["tpot"] or 0.0, "e2el": lambda r: r["e2el"]}
        good = sum(all(slo / 1000 >= per_request[k](r) for k, slo in goodput.items()) for r in ok)
    return {
        "concurrency": concurrency,
        "request_rate": request_rate,
        "completed": len(ok),
        "failed": len(errors),
        "errors": errors[:MAX_ERRORS],
        "duration_s": duration,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "request_goodput": None if good is None else good / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        **{
            f"{name}_ms": _stat(v, list(metric_percentiles) if name in percentile_metrics else None)
            for name, v in values.items()
        },
    }
