"""Running a benchmark (the `tunedeck.benchmarks.run` task, on the endpoint's pool): load sent straight
to the endpoint's model server from its host, level by level, measured as `vllm bench serve` measures:

- TTFT: request sent -> first streamed chunk with text; ITL: the gaps between chunks with text;
- TPOT: (E2E - TTFT) / (output tokens - 1) per request; E2E latency: sent -> last chunk;
- request and output-token throughput: completed requests and output tokens / the level's duration.

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
    return summarize(results, duration, concurrency=None if request_rate else concurrency, request_rate=request_rate)


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
    sent = time.perf_counter()
    chunks: list[float] = []  # when each chunk with text came
    last = sent  # when the last chunk with a choice came (its finish reason may carry no text)
    usage = None
    path = "chat/completions" if chat else "completions"
    try:
        async with client.post(f"{url}/v1/{path}", json=payload) as r:
            if r.status != 200:
                text = (await r.read()).decode(errors="replace")
                return {"error": f"HTTP {r.status}: {text[:200]}"}
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if choices := chunk.get("choices"):
                    last = time.perf_counter()
                    if choices[0].get("text") or (choices[0].get("delta") or {}).get("content"):
                        chunks.append(last)
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except aiohttp.ClientError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not chunks:
        return {"error": "the reply had no tokens"}
    output = usage["completion_tokens"] if usage else len(chunks)
    ttft, e2el = chunks[0] - sent, last - sent
    return {
        "ttft": ttft,
        "e2el": e2el,
        "itl": list(np.diff(chunks)),
        "tpot": (e2el - ttft) / (output - 1) if output > 1 else None,
        "input_tokens": usage["prompt_tokens"] if usage else 0,
        "output_tokens": output,
    }


def _stat(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ms = np.asarray(values, dtype=np.float64) * 1000
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "p99": float(np.percentile(ms, 99))}


def summarize(results: list[dict], duration: float, *, concurrency: int | None, request_rate: float | None) -> dict:
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    input_tokens = sum(r["input_tokens"] for r in ok)
    output_tokens = sum(r["output_tokens"] for r in ok)
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
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": _stat([r["ttft"] for r in ok]),
        "tpot_ms": _stat([r["tpot"] for r in ok if r["tpot"] is not None]),
        "itl_ms": _stat([gap for r in ok for gap in r["itl"]]),
        "e2el_ms": _stat([r["e2el"] for r in ok]),
    }
