"""The built-in model server: vLLM's HTTP API over ``generate.Engine``.

    python -m worker.serve --model DIR --served-model-name NAME [--host H] [--port P]
                           [--max-num-seqs N] [--max-model-len N] [--log-stats-interval S] [--api-key KEY]

``/health``, ``/v1/models``, ``/v1/completions`` (a text or token-id prompt; ``echo`` with ``max_tokens`` 0
and ``logprobs``: the prompt's log-probabilities, as evaluations ask for a reference's likelihood) and
``/v1/chat/completions`` (SSE streaming with
``stream_options.include_usage``; the model's own chat template, with ``chat_template_kwargs`` such as
``enable_thinking``; the reasoning channel returned apart as ``reasoning_content``, as vLLM's reasoning
parsers do; every stop id of ``generation_config.json`` and ``stop``; ``max_tokens``, ``temperature``,
``top_p``, ``seed``), and ``/metrics`` with vLLM's metric names, so what probes,
scrapes and benchmarks a vLLM endpoint works on this one unchanged. Its output, which the endpoint
page shows, says where it serves once ready, then (as vLLM's does) every few seconds while it is
busy: prompt and generation throughput, running and waiting requests, KV cache use.

With a key (``--api-key``, or ``VLLM_API_KEY`` in its environment, which the endpoint supervisor uses so
that the key is not on a command line anyone on the host can read), every route but ``/health``
answers only ``Authorization: Bearer <key>`` and refuses anyone else with vLLM's 401, as vLLM's own
``AuthenticationMiddleware`` does (recent releases guard everything but the probes' paths; older ones
guarded ``/v1`` only: Tunedeck's clients send the key everywhere).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import os
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, Field, ValidationError

from worker.chat import ChatTemplateError
from worker.serve import generate

# vLLM's buckets for these histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class Message(BaseModel):
    role: str = Field(pattern="^(system|user|assistant)$")
    content: str


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's: go on past end-of-sequence tokens, up to max_tokens (benchmarks)

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: e.g. {"enable_thinking": true}


class CompletionRequest(Sampling):
    prompt: str | list[int] = Field(min_length=1)  # text, or token ids (taken as they are: no BOS added)
    max_tokens: int | None = Field(default=None, ge=0)  # 0: only with echo, to score the prompt
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=generate.TOP_LOGPROBS)


class Metrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token, from arrival", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between output tokens", ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "Time per output token", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token", E2E_BUCKETS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", labels, registry=r).labels(model)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", labels, registry=r).labels(model)
        self.requests = Counter("vllm:request_success", "Finished requests", [*labels, "finished_reason"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests being decoded", labels, registry=r).labels(model)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", labels, registry=r).labels(model)
        self.kv_cache = Gauge("vllm:kv_cache_usage_perc", "KV cache rows in use (0-1)", labels, registry=r).labels(
            model
        )
        self.model = model

    def total(self, sample: str) -> float:
        return self.registry.get_sample_value(sample, {"model_name": self.model}) or 0.0


class Arrival:
    """Stamps each request when the server first sees it, before routing, reading and parsing the body:
    vLLM's "arrival", which its time-to-first-token histogram counts from."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        scope["arrival"] = time.perf_counter()
        await self.app(scope, receive, send)


class ApiKey:
    """vLLM's check of ``--api-key``: a request without ``Authorization: Bearer <key>`` gets 401 with
    ``{"error": "Unauthorized"}``, except on ``OPEN_PATHS`` (liveness). Compared as digests in constant time."""

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.digest = hashlib.sha256(key.encode()).digest()

    def allowed(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, given = value.partition(b" ")
                return scheme.lower() == b"bearer" and secrets.compare_digest(
                    hashlib.sha256(given).digest(), self.digest
                )
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS and not self.allowed(scope):
            return await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)


class Generation:
    """One request's tokens, from the engine thread to the event loop, with its timings."""

    def __init__(
        self, server: Server, prompt_ids: list[int], body: Sampling, arrival: float, *, reasoning: bool = False
    ) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stops = body.stops
        self.prompt_tokens = len(prompt_ids)
        self.ids: list[int] = []
        self.parser = server.engine.tokenizer.reply_parser(reasoning=reasoning)
        self.text = ""  # the content sent so far
        self.reasoning = ""  # the reasoning sent so far
        self.finish_reason: str | None = None
        max_tokens = body.max_tokens or server.engine.max_model_len - len(prompt_ids)
        self.request = generate.Request(
            prompt_ids,
            max_tokens,
            self._emit,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            arrival=arrival,
        )
        self.first_at: float | None = None  # the first text sent
        self.first_token_at: float | None = None  # the first token on the event loop
        self.last_at: float | None = None

    def _emit(self, token: int | None, finish: str | None) -> None:  # on the engine thread
        if token is not None:  # counted as generated, as vLLM counts, even if its client has gone
            self.server.metrics.generation_tokens.inc()
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (token, finish))

    def _timing(self) -> None:
        """A token reached the event loop."""
        now = time.perf_counter()
        if self.last_at is not None:
            self.server.metrics.itl.observe(now - self.last_at)
        else:
            self.first_token_at = now
        self.last_at = now

    def first_sent(self) -> None:
        """The first text is out (handed to the socket, or the whole reply built): time to first token."""
        if self.first_at is None:
            self.first_at = time.perf_counter()
            self.server.metrics.ttft.observe(self.first_at - self.request.arrival)

    async def deltas(self, announce: bool = False):
        """The reply as it grows: ``("reasoning" | "content", text)`` pieces. A stop string ends the
        content before the string; text that could be the start of a stop string is held back until the
        next tokens tell (as vLLM does). ``announce``: a ``("start", "")`` first, once the first token is
        out (when vLLM's chat stream sends its role chunk)."""
        engine = self.server.engine
        hold = max((len(s) for s in self.stops), default=1) - 1
        self.server.metrics.prompt_tokens.inc(self.prompt_tokens)
        engine.submit(self.request)
        full = ""
        try:
            while self.finish_reason is None:
                item = await self.queue.get()
                if announce and item[0] is not None and self.first_token_at is None:
                    yield "start", ""
                token, finish = item
                if finish is not None:
                    if token is not None:  # the end token: counted, not shown
                        self._timing()
                        self.ids.append(token)
                    self.finish_reason = finish
                    end = len(full)  # the held-back tail goes out
                else:
                    self._timing()
                    self.ids.append(token)
                    if self.parser.add(token) == "reasoning":
                        thought = self.parser.reasoning()
                        if thought and not thought.endswith("\ufffd") and len(thought) > len(self.reasoning):
                            delta, self.reasoning = thought[len(self.reasoning) :], thought
                            yield "reasoning", delta
                        continue
                    full = self.parser.content()
                    if full.endswith("\ufffd"):
                        continue  # a character split across tokens: wait for the rest
                    end = len(full) - hold
                    found = [at for s in self.stops if (at := full.find(s, max(0, len(self.text) - len(s)))) >= 0]
                    if found:
                        end = min(found)
                        self.finish_reason = "stop"
                        engine.finish_early(self.request)
                if end > len(self.text):
                    delta = full[len(self.text) : end]
                    self.text += delta
                    yield "content", delta
        finally:
            if self.finish_reason is None:  # the client went away
                engine.finish_early(self.request)
            self._record()

    def _record(self) -> None:
        m = self.server.metrics
        now = time.perf_counter()
        m.e2e.observe(now - self.request.arrival)
        if len(self.ids) > 1:
            assert self.last_at is not None and self.first_token_at is not None, "set by the first token"
            m.tpot.observe((self.last_at - self.first_token_at) / (len(self.ids) - 1))
        if self.finish_reason in ("stop", "length"):
            m.requests.labels(m.model, self.finish_reason).inc()

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.ids),
            "total_tokens": self.prompt_tokens + len(self.ids),
        }


class Server:
    def __init__(self, engine: generate.Engine, served_model_name: str) -> None:
        self.engine = engine
        self.name = served_model_name
        self.metrics = Metrics(served_model_name)
        self.created = int(time.time())

    def chat_prompt(self, body: ChatRequest) -> list[int]:
        """The model's chat template over the messages, with the generation prompt (ValueError when the
        template fails or the model has none)."""
        chat = self.engine.tokenizer
        if not chat.has_template:
            raise ValueError("This model has no chat template; use /v1/completions.")
        try:
            return chat.prompt_ids([m.model_dump() for m in body.messages], **(body.chat_template_kwargs or {}))
        except ChatTemplateError as exc:
            raise ValueError(f"The chat template failed: {exc}") from exc


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def log_stats(server: Server, every_s: float) -> None:
    """A line every ``every_s`` while busy, and one more when it goes idle (vLLM's stats line)."""
    m, e = server.metrics, server.engine

    def totals() -> tuple[float, float]:
        return m.total("vllm:prompt_tokens_total"), m.total("vllm:generation_tokens_total")

    last, last_at, busy_before = totals(), time.perf_counter(), False
    while True:
        await asyncio.sleep(every_s)
        now, now_at = totals(), time.perf_counter()
        prompt, generation = ((b - a) / (now_at - last_at) for a, b in zip(last, now, strict=True))
        last, last_at = now, now_at
        busy = bool(prompt or generation or e.running or e.waiting)
        if busy or busy_before:
            print(
                f"tunedeck: avg prompt throughput: {prompt:.1f} tokens/s, avg generation throughput: "
                f"{generation:.1f} tokens/s, running: {e.running} reqs, waiting: {e.waiting} reqs, "
                f"KV cache usage: {e.running / e.max_num_seqs:.1%}",
                flush=True,
            )
        busy_before = busy


def create_app(
    server: Server, *, url: str | None = None, stats_every_s: float = 0, api_key: str | None = None
) -> FastAPI:
    """The server's app; it prints where it serves (``url``) once listening, and its stats line every
    ``stats_every_s`` while busy (0: never). With ``api_key``, it answers only that key's bearer (``ApiKey``)."""

    @asynccontextmanager
    async def lifespan(_app):
        if url:
            e = server.engine
            print(
                f"tunedeck: serving {server.name} at {url} (max_num_seqs {e.max_num_seqs}, "
                f"max_model_len {e.max_model_len})",
                flush=True,
            )
        stats = asyncio.ensure_future(log_stats(server, stats_every_s)) if stats_every_s > 0 else None
        yield
        if stats is not None:
            stats.cancel()

    app = FastAPI(title="Tunedeck model server", docs_url=None, redoc_url=None, lifespan=lifespan)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)
    app.add_middleware(Arrival)  # outermost: arrival is stamped before anything else runs

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    def list_models() -> dict:
        card = {
            "id": server.name,
            "object": "model",
            "created": server.created,
            "owned_by": "tunedeck",
            "root": str(server.engine.model_dir),
            "max_model_len": server.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    def metrics() -> Response:
        m, e = server.metrics, server.engine
        m.running.set(e.running)
        m.waiting.set(e.waiting)
        m.kv_cache.set(e.running / e.max_num_seqs)
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    async def parse(request: Request, schema: type[Sampling]) -> Sampling | JSONResponse:
        try:
            body = schema.model_validate_json(await request.body())
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            return _error(400, f"{where}: {err['msg']}", where)
        if body.model != server.name:
            return _error(404, f"The model `{body.model}` does not exist.", "model")
        return body

    async def respond(request: Request, body: Sampling, chat: bool) -> Response:
        tok = server.engine.tokenizer
        try:
            if isinstance(body, ChatRequest):
                prompt_ids = server.chat_prompt(body)
            else:
                assert isinstance(body, CompletionRequest), "parsed as one or the other"
                if isinstance(body.prompt, list):
                    if not all(0 <= t < server.engine.vocab_size for t in body.prompt):
                        raise ValueError(f"prompt: token ids are 0 to {server.engine.vocab_size - 1}")
                    prompt_ids = body.prompt
                else:
                    prompt_ids = [*tok.bos, *tok.encode(body.prompt)]
                if body.echo or body.max_tokens == 0 or body.logprobs is not None:
                    return await scored(request, body, prompt_ids)
            arrival = request.scope.get("arrival") or time.perf_counter()
            gen = Generation(server, prompt_ids, body, arrival, reasoning=chat)
            if len(prompt_ids) + 1 > server.engine.max_model_len:
                raise ValueError(
                    f"This model's maximum context length is {server.engine.max_model_len} tokens; the prompt has "
                    f"{len(prompt_ids)}."
                )
        except ValueError as exc:
            return _error(400, str(exc), "messages" if chat else "prompt")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def choice(text: str | None, finish: str | None, first: bool = False, kind: str = "content") -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            if first:
                delta = {"role": "assistant", "content": ""}
            else:
                delta = {"reasoning_content" if kind == "reasoning" else "content": text} if text else {}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        if body.stream:
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"
            usage = body.stream_options is not None and body.stream_options.include_usage

            async def events():
                head = {"id": rid, "object": chunk_obj, "created": created, "model": server.name}
                role = _sse({**head, "choices": [choice("", None, first=True)]})
                announced = not chat  # a completion has no role chunk
                async for kind, delta in gen.deltas(announce=chat):
                    if kind == "start":  # the role, with the first token (as vLLM's first engine output)
                        yield role
                        announced = True
                        continue
                    yield _sse({**head, "choices": [choice(delta, None, kind=kind)]})
                    gen.first_sent()  # resumed: the chunk was written
                if not announced:  # no token came (the client has the role all the same)
                    yield role
                yield _sse({**head, "choices": [choice(None, gen.finish_reason)]})
                if usage:
                    yield _sse({**head, "choices": [], "usage": gen.usage})
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        async for _ in gen.deltas():
            pass
        gen.first_sent()
        if chat:
            message = {"role": "assistant", "content": gen.text, "reasoning_content": gen.reasoning or None}
            c = {"index": 0, "message": message, "finish_reason": gen.finish_reason}
        else:
            c = {"index": 0, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason}
        return JSONResponse(
            {"id": rid, "object": obj, "created": created, "model": server.name, "choices": [c], "usage": gen.usage}
        )

    async def scored(request: Request, body: CompletionRequest, prompt_ids: list[int]) -> Response:
        """``echo`` with ``max_tokens`` 0: the prompt back, with ``logprobs`` its tokens' log-probabilities
        in OpenAI's completions form (the first token has none), as vLLM answers it. What else vLLM does
        with echo and logprobs (the generated tokens' too) the built-in server does not: a 400 says so."""
        if not body.echo or body.max_tokens != 0:
            what = "echo" if body.echo else "max_tokens" if body.max_tokens == 0 else "logprobs"
            raise ValueError(
                f"{what}: this server gives the prompt's log-probabilities (echo with max_tokens 0 and logprobs), "
                "not the generated tokens'"
            )
        if body.stream:
            raise ValueError("stream: an echoed prompt's log-probabilities are not streamed")
        arrival = request.scope.get("arrival") or time.perf_counter()
        taken, best, best_ids = await run_in_threadpool(server.engine.score, prompt_ids)
        tok = server.engine.tokenizer
        pieces = [tok.decode([t]) for t in prompt_ids]
        c: dict[str, Any] = {"index": 0, "text": tok.decode(prompt_ids), "logprobs": None, "finish_reason": "length"}
        if body.logprobs is not None:
            top: list[dict[str, float] | None] = [None]
            for k in range(len(taken)):
                entries = {pieces[k + 1]: float(taken[k])}
                for t, lp in zip(best_ids[k, : body.logprobs], best[k, : body.logprobs], strict=True):
                    entries.setdefault(tok.decode([int(t)]), float(lp))
                top.append(entries)
            offsets = [0, *itertools.accumulate(len(p) for p in pieces[:-1])]
            c["logprobs"] = {
                "text_offset": offsets,
                "token_logprobs": [None, *(max(float(v), -9999.0) for v in taken)],
                "tokens": pieces,
                "top_logprobs": top,
            }
        server.metrics.prompt_tokens.inc(len(prompt_ids))
        server.metrics.requests.labels(server.name, "length").inc()
        server.metrics.e2e.observe(time.perf_counter() - arrival)
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": 0, "total_tokens": len(prompt_ids)}
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": server.name,
                "choices": [c],
                "usage": usage,
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse(request, ChatRequest)
        if isinstance(body, JSONResponse):
            return body
        return await respond(request, body, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        if isinstance(body, JSONResponse):
            return body
        return await respond(request, body, chat=False)

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from worker.processes import lean_jax_imports

    lean_jax_imports()

    ap = argparse.ArgumentParser(description="Tunedeck's built-in model server (vLLM's HTTP API)")
    ap.add_argument("--model", required=True, help="a Hugging Face checkpoint directory (a merged artifact)")
    ap.add_argument("--served-model-name", default=None, help="the model id clients use (default: the directory)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--max-num-seqs", type=int, default=16, help="requests decoded together at most")
    ap.add_argument("--max-model-len", type=int, default=1024, help="prompt + reply tokens at most")
    ap.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between stats lines (0: none)")
    ap.add_argument(
        "--api-key",
        default=None,
        help="answer only 'Authorization: Bearer KEY' (all but /health); default: $VLLM_API_KEY, else anyone",
    )
    args = ap.parse_args(argv)
    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None

    print("tunedeck-phase: loading", flush=True)
    engine = generate.Engine(args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    print("tunedeck-phase: compiling", flush=True)
    engine.start()
    server = Server(engine, args.served_model_name or args.model)
    url = f"http://{args.host}:{args.port}"
    app = create_app(server, url=url, stats_every_s=args.log_stats_interval, api_key=api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
