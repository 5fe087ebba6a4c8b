"""Running an evaluation (the `tunedeck.evaluations.run` task, on the evaluation's pool): each subject in
turn is served (a run checkpoint: merged, if it is not yet, by this worker, then started with the pool's
runtime, as an endpoint would be; a base model: started from its directory; a ready endpoint: used as it
is), asked every prompt of the eval set, ``concurrency`` requests in flight so the model server batches
them, and stopped. With a judge (``Judge``), it is asked one short question before any subject is served
(a judge that cannot answer fails the evaluation at once), and once every subject has answered, it grades
each answer and, with pairwise judging, compares answers in both orders. The replies are scored and stored
at the end (``evaluations.record``).

Replies are greedy (temperature 0) and not streamed. A thread beats the evaluation's heartbeat
(``worker.beat.Beat``) and reads the user's cancel: the requests in flight are closed, the model server
is stopped, and the evaluation ends ``cancelled``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import httpx
import orjson
from sqlmodel import Session

from app.artifacts import service as artifacts
from app.artifacts.models import Artifact, ArtifactKind, ArtifactStatus
from app.benchmarks.service import DEFAULT_MAX_MODEL_LEN
from app.core.config import get_settings
from app.core.db import session_scope
from app.core.security import unseal
from app.datasets.models import Dataset
from app.datasets.validation import iter_numbered_conversations
from app.endpoints import service as endpoints
from app.endpoints.models import Endpoint, EndpointStatus
from app.evaluations import judge as judge_lib
from app.evaluations import service as evaluations
from app.evaluations.models import Evaluation
from app.pools.models import Pool
from app.runs.models import Run
from worker import artifacts as artifact_builds
from worker import leases, runtimes
from worker.beat import Beat
from worker.chat import ChatFormat, ChatTemplateError
from worker.endpoints import log_path
from worker.model_cache import local_artifact, local_dataset
from worker.probe import auth
from worker.processes import free_port
from worker.runs import base_model_dir, model_dir

READY_TIMEOUT_S = 3600.0  # a vLLM start of a large model compiles for many minutes
POLL_S = 0.5
PROGRESS_EVERY_S = 1.0

log = logging.getLogger(__name__)


class Stopped(Exception):  # noqa: N818 - not an error: the evaluation was told to stop
    pass


def execute(evaluation_id: str, worker: str) -> None:
    """The Celery task's body. The evaluation serves its subjects on this host's chips (and merges the
    checkpoints it serves, verification and all): it holds their lease throughout, or waits for it
    queued, saying so."""
    lease = leases.take_or_wait(
        f"evaluation {evaluation_id}",
        lambda session, why, retry_s: evaluations.wait_for_chips(session, evaluation_id, why, retry_s),
    )
    if lease is None:
        return
    with lease:
        _evaluate(evaluation_id, worker)


def _evaluate(evaluation_id: str, worker: str) -> None:
    with session_scope() as session:
        evaluation = evaluations.start(session, evaluation_id, worker)
        if evaluation is None:
            return
        with Beat(evaluations.heartbeat, evaluation_id, worker) as beat:
            try:
                _run(session, evaluation, worker, beat.stop)
            except Stopped:
                if beat.reason == "cancel":
                    evaluations.cancelled(session, evaluation)
                else:
                    log.warning("evaluation %s is no longer this worker's: it stopped", evaluation_id)
            except Exception as exc:
                evaluations.fail(session, evaluation, f"{type(exc).__name__}: {exc}")
                raise


def eval_set(session: Session, evaluation: Evaluation) -> list[dict[str, Any]]:
    """The eval set's first ``max_samples`` conversations that end with an assistant message: the
    messages before it are the prompt, it is the reference. A run's validation split is the records of
    its training file that training held out (or its validation dataset)."""
    dataset = session.get(Dataset, evaluation.dataset_id) if evaluation.dataset_id else None
    if dataset is None:
        raise RuntimeError(f"dataset {evaluation.dataset_id} was deleted")
    held_out = _held_out(session, evaluation)
    rows: list[dict[str, Any]] = []
    path = local_dataset(dataset, log.info)
    numbered = iter_numbered_conversations(path, dataset.filename, file_type=dataset.file_type, fmt=dataset.format)
    for line, messages in numbered:
        if held_out is not None and line not in held_out:
            continue
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None or not any(m["role"] == "user" for m in messages[:last]):
            continue
        rows.append({"position": len(rows), "messages": messages[:last], "reference": messages[last]["content"]})
        if len(rows) == evaluation.config["max_samples"]:
            break
    if not rows:
        raise RuntimeError(f"no conversation of dataset {dataset.id} ends with an assistant reply to a user")
    return rows


def _held_out(session: Session, evaluation: Evaluation) -> set[int] | None:
    """The lines of the run's training file held out for validation, when the eval set is that split."""
    run_id = evaluation.config.get("validation_of")
    if run_id is None:
        return None
    run = session.get(Run, run_id)
    if run is None:
        raise RuntimeError(f"run {run_id} was deleted, and its validation split with it")
    return None if run.validation_dataset_id is not None else set(run.held_out_lines or ())


def _run(session: Session, evaluation: Evaluation, worker: str, stop: threading.Event) -> None:
    rows = eval_set(session, evaluation)
    for row in rows:
        row["outputs"], row["judgements"] = {}, {}
    judge = Judge.of(session, evaluation)
    if judge is not None:  # before any subject is served: a judge that cannot answer fails it now
        evaluations.progress(session, evaluation, phase="checking the judge")
        judge.check()
    total = len(rows) * evaluations.requests_per_sample(len(evaluation.subjects), evaluation.config)
    evaluations.progress(session, evaluation, total=total)
    done = 0
    for subject in evaluation.subjects:
        label = subject["label"]
        evaluations.progress(session, evaluation, phase=f"serving {label}")
        held = time.monotonic()
        with served(session, evaluation, subject, worker, stop) as (url, key, model, directory):
            evaluations.progress(session, evaluation, phase=f"asking {label}")
            replies = asyncio.run(
                ask(
                    f"{url}/v1",
                    model,
                    [r["messages"] for r in rows],
                    max_tokens=evaluation.config["max_tokens"],
                    concurrency=evaluation.config["concurrency"],
                    headers=auth(key),
                    stop=stop,
                    on_reply=_Progress(evaluation.id, done, len(rows)),
                )
            )
            done += len(rows)
            if "perplexity" in evaluation.config["metrics"]:
                evaluations.progress(session, evaluation, phase=f"scoring the references under {label}")
                scored = asyncio.run(
                    likelihoods(
                        f"{url}/v1",
                        model,
                        ChatFormat(directory),
                        rows,
                        concurrency=evaluation.config["concurrency"],
                        headers=auth(key),
                        stop=stop,
                        on_reply=_Progress(evaluation.id, done, len(rows)),
                    )
                )
                for row, likelihood in zip(rows, scored, strict=True):
                    if likelihood is not None:
                        row.setdefault("likelihoods", {})[subject["key"]] = likelihood
                done += len(rows)
        evaluations.progress(session, evaluation, chip_s=(time.monotonic() - held) * evaluation.chips)
        for row, reply in zip(rows, replies, strict=True):
            row["outputs"][subject["key"]] = reply
    if judge is not None:
        evaluations.progress(session, evaluation, phase="judging")
        judge.judge(rows, [s["key"] for s in evaluation.subjects], stop, _Progress(evaluation.id, done, total - done))
    evaluations.progress(session, evaluation, phase="scoring", done=total)
    evaluations.record(session, evaluation, rows)
    evaluations.finish(session, evaluation)


class _Progress:
    """Counts a subject's replies (on the event loop) into the evaluation's ``samples_done``, written at
    most every ``PROGRESS_EVERY_S`` and at the last reply, with a session of its own."""

    def __init__(self, evaluation_id: str, before: int, replies: int) -> None:
        self.evaluation_id, self.before, self.replies = evaluation_id, before, replies
        self.written = 0.0

    def __call__(self, answered: int) -> None:
        if time.monotonic() - self.written >= PROGRESS_EVERY_S or answered == self.replies:
            self.written = time.monotonic()
            with session_scope() as session:
                evaluation = session.get_one(Evaluation, self.evaluation_id)
                evaluations.progress(session, evaluation, done=self.before + answered)


@contextmanager
def served(
    session: Session, evaluation: Evaluation, subject: dict, worker: str, stop: threading.Event
) -> Iterator[tuple[str, str | None, str, str]]:
    """(url, key, model, its checkpoint's directory) of a model server answering for the subject while the
    block runs."""
    if subject["kind"] == "endpoint":
        endpoint = session.get(Endpoint, subject["endpoint_id"])
        if endpoint is None or endpoint.status != EndpointStatus.ready or endpoint.url is None:
            state = endpoint.status if endpoint else "deleted"
            raise RuntimeError(f"endpoint {subject['endpoint_id']} is {state}: it was ready when asked to evaluate it")
        artifact = session.get(Artifact, endpoint.artifact_id)
        if artifact is None:
            raise RuntimeError(f"endpoint {endpoint.id}'s artifact was deleted")
        directory = artifact.path
        if artifact.kind == ArtifactKind.adapter:  # served on its base, whose tokenizer it is
            directory = str(base_model_dir(session, session.get_one(Run, artifact.run_id))[0])
        yield endpoint.url, endpoint.api_key, endpoint.model, directory
        return
    if subject["kind"] == "checkpoint":
        artifact = _merged(session, evaluation, subject, worker, stop)
        directory = str(local_artifact(artifact, lambda: artifacts.served(session), log=log.info))
    else:  # a base model, served from its own directory as a merged checkpoint would be
        path, _ = model_dir(session, subject["base_model"])
        artifact = Artifact(
            id=f"{evaluation.id}-{subject['key']}",
            owner_id=evaluation.owner_id,
            run_id="",
            kind=ArtifactKind.merged,
            checkpoint_step=0,
            name=subject["label"],
        )
        directory = artifact.path = str(path)
    pool = session.get(Pool, evaluation.pool)
    if pool is None:
        raise RuntimeError(f"pool {evaluation.pool} no longer exists")
    # Not a row: an endpoint of the evaluation's own, which no one else can reach (its key is new)
    endpoint = Endpoint(
        id=f"{evaluation.id}-{subject['key']}",
        owner_id=evaluation.owner_id,
        artifact_id=artifact.id,
        model=f"{evaluation.id}-{subject['key']}",
        pool=pool.name,
        runtime=endpoints.runtime_for(pool),
        settings={"max_model_len": DEFAULT_MAX_MODEL_LEN, "max_num_seqs": evaluation.config["concurrency"]},
        api_key=secrets.token_urlsafe(32),
    )
    host = get_settings().serve_host
    port = free_port(host)
    url = f"http://{host}:{port}"
    server_log = log_path(endpoint.id)  # beside the endpoints' own logs
    server_log.parent.mkdir(parents=True, exist_ok=True)
    # Whole checkpoints only (a merge, or a base model): no adapter on a base to serve
    server = runtimes.model_server(
        endpoint, artifact, pool, model_dir=directory, host=host, port=port, log=server_log, base_dir=None
    )
    try:
        server.start(lambda _phase: None)
        _wait_ready(server, url, endpoint.api_key, stop)
        yield url, endpoint.api_key, endpoint.model, directory
    finally:
        server.stop()


def _merged(session: Session, evaluation: Evaluation, subject: dict, worker: str, stop: threading.Event) -> Artifact:
    """The checkpoint's merged artifact, built here if no one has yet, waited for if another worker is on it."""
    artifact = evaluations.checkpoint_artifact(session, evaluation, subject)
    if artifact.status == ArtifactStatus.queued:
        evaluations.progress(session, evaluation, phase=f"merging {subject['label']}")
        # under this evaluation's lease; nothing when another worker took it meanwhile
        artifact_builds.supervise_build(artifact.id, worker)
    while True:
        session.refresh(artifact)
        if artifact.status == ArtifactStatus.succeeded:
            return artifact
        if artifact.status == ArtifactStatus.failed:
            raise RuntimeError(f"the merge of {subject['label']} ({artifact.id}) failed: {artifact.error}")
        if stop.wait(POLL_S):
            raise Stopped


def _wait_ready(server: runtimes.ModelServer, url: str, key: str | None, stop: threading.Event) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        reason = server.exit_reason()
        if reason is not None:
            raise RuntimeError(reason)
        try:
            if httpx.get(f"{url}/health", headers=auth(key), timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if stop.wait(POLL_S):
            raise Stopped
    raise RuntimeError(f"the model server was not ready after {READY_TIMEOUT_S:.0f}s")


class Judge:
    """The evaluation's LLM judge: where it is asked, and what (``app.evaluations.judge``)."""

    def __init__(self, config: dict[str, Any], base_url: str, key: str | None, concurrency: int) -> None:
        self.config, self.base_url, self.key, self.concurrency = config, base_url, key, concurrency

    @classmethod
    def of(cls, session: Session, evaluation: Evaluation) -> Judge | None:
        config = evaluation.config.get("judge")
        if config is None:
            return None
        if config["endpoint_id"] is not None:
            endpoint = session.get(Endpoint, config["endpoint_id"])
            if endpoint is None or endpoint.status != EndpointStatus.ready or endpoint.url is None:
                state = endpoint.status if endpoint else "deleted"
                raise RuntimeError(f"the judge, endpoint {config['endpoint_id']}, is {state}")
            return cls(config, f"{endpoint.url}/v1", endpoint.api_key, evaluation.config["concurrency"])
        key = unseal(evaluation.judge_key) if evaluation.judge_key else None
        return cls(config, config["url"].rstrip("/"), key, evaluation.config["concurrency"])

    @property
    def where(self) -> str:
        return self.config["url"] or f"endpoint {self.config['endpoint_id']}"

    def check(self) -> None:
        """One short chat request: the judge answers, in OpenAI's chat format, or the evaluation fails
        with what it answered instead."""
        url = f"{self.base_url}/chat/completions"
        body = {"model": self.config["model"], "messages": [{"role": "user", "content": "Reply with OK."}]}
        try:
            r = httpx.post(url, json={**body, "max_tokens": 4, "temperature": 0.0}, headers=auth(self.key), timeout=60)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"the judge at {self.where} did not answer: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise RuntimeError(f"the judge at {self.where} answered HTTP {r.status_code}: {r.text[:300]}")
        try:
            content = r.json()["choices"][0]["message"]["content"]
            if not isinstance(content, str | None):
                raise TypeError(type(content).__name__)
        except (ValueError, LookupError, TypeError):
            raise RuntimeError(
                f"the judge at {self.where} did not answer with an OpenAI chat completion: {r.text[:300]}"
            ) from None

    def judge(self, rows: list[dict], keys: list[str], stop: threading.Event, on_reply: Callable[[int], None]) -> None:
        """Each subject's answer graded, and with ``pairwise`` the first subject's compared with each
        other's in both orders; the verdicts go into each row's ``judgements``."""
        rubric, prompt = self.config["rubric"], self.config["prompt"]
        rows_by_position = {row["position"]: row for row in rows}
        asks: list[tuple[dict, str, str | None, str]] = []  # (row, subject key or pair, order, prompt)
        for row in rows:
            for k in keys:
                text = judge_lib.grading_prompt(rubric, prompt, row["messages"], row["reference"], row["outputs"][k])
                asks.append((row, k, None, text))
            if self.config["pairwise"]:
                for pair in evaluations.pairs(keys):
                    a, b = pair.split(":")
                    first, second = row["outputs"][a], row["outputs"][b]
                    asks.append(
                        (
                            row,
                            pair,
                            "A first",
                            judge_lib.pairwise_prompt(rubric, prompt, row["messages"], row["reference"], first, second),
                        )
                    )
                    asks.append(
                        (
                            row,
                            pair,
                            "B first",
                            judge_lib.pairwise_prompt(rubric, prompt, row["messages"], row["reference"], second, first),
                        )
                    )
        replies = asyncio.run(
            ask(
                self.base_url,
                self.config["model"],
                [[{"role": "user", "content": text}] for *_, text in asks],
                max_tokens=self.config["max_tokens"],
                concurrency=self.concurrency,
                headers=auth(self.key),
                stop=stop,
                on_reply=on_reply,
                keep_refusals=True,
            )
        )
        verdicts: dict[tuple[int, str], list[str]] = {}
        for (row, name, order, _), reply in zip(asks, replies, strict=True):
            if order is None:
                parsed = judge_lib.parse_score(reply)
                row["judgements"][name] = (
                    {"score": parsed[0], "reason": parsed[1]} if parsed else {"unparsable": reply[:2000]}
                )
            else:  # "A first", then "B first"
                verdicts.setdefault((row["position"], name), []).append(reply)
        for (position, pair), (a_first, b_first) in verdicts.items():
            rows_by_position[position]["judgements"][pair] = judge_lib.pair_outcome(a_first, b_first)


async def ask(
    url: str,
    model: str,
    prompts: list[list[dict]],
    *,
    max_tokens: int,
    concurrency: int,
    headers: dict[str, str] | None = None,
    stop: threading.Event | None = None,
    on_reply: Callable[[int], None] | None = None,
    keep_refusals: bool = False,
) -> list[str]:
    """Each prompt's greedy reply from the OpenAI-compatible server at ``url`` (its base URL, ``.../v1``),
    in order, at most ``concurrency`` requests in flight. A request that fails raises (naming the
    prompt), except, with ``keep_refusals``, one the server refuses as a bad request (a 4xx but 401,
    403 and 404): its reply is then "(refused: ...)", which a judge's verdict is counted unparsable for;
    ``stop`` closes those in flight and raises ``Stopped``."""
    gate = asyncio.Semaphore(concurrency)
    replies: list[str | None] = [None] * len(prompts)
    answered = 0
    async with _client(headers) as client:

        async def one(i: int) -> None:
            nonlocal answered
            async with gate:
                body = {"model": model, "messages": prompts[i], "max_tokens": max_tokens, "temperature": 0.0}
                async with client.post(f"{url}/chat/completions", json=body) as r:
                    text = await r.read()
                    if keep_refusals and 400 <= r.status < 500 and r.status not in (401, 403, 404):
                        # This prompt refused (too long for the judge's context, say): its reply, the refusal
                        replies[i] = f"(refused: HTTP {r.status}: {text[:300].decode(errors='replace')})"
                        answered += 1
                        if on_reply is not None:
                            on_reply(answered)
                        return
                    if r.status != 200:
                        raise RuntimeError(
                            f"sample {i}: HTTP {r.status} from {url}: {text[:300].decode(errors='replace')}"
                        )
                    message = (await r.json(content_type=None))["choices"][0]["message"]
            replies[i] = message.get("content") or ""
            answered += 1
            if on_reply is not None:
                on_reply(answered)

        await _all(one, len(prompts), stop)
    return [r or "" for r in replies]


def _client(headers: dict[str, str] | None) -> aiohttp.ClientSession:
    """The session a subject's requests share: no total timeout (a long reply takes what it takes), no
    connection limit (the semaphore of ``concurrency`` is the limit)."""
    timeout = aiohttp.ClientTimeout(total=None, connect=30)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0), headers=headers)


async def _all(one: Callable[[int], Any], n: int, stop: threading.Event | None) -> None:
    """``one(i)`` for i in 0..n together; ``stop`` cancels those in flight and raises ``Stopped``."""
    work = asyncio.ensure_future(asyncio.gather(*(one(i) for i in range(n))))
    while not work.done():
        if stop is not None and stop.is_set():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise Stopped
        await asyncio.wait({work}, timeout=0.1)
    await work


def reference_tokens(chat: ChatFormat, messages: list[dict], reference: str) -> tuple[list[int], list[int]]:
    """The conversation answered with the reference, as the model's chat template renders it, and the
    positions of the reference's tokens in it: those the training loss takes for that reply (its
    end-of-turn token included). ValueError when the template renders the prompt otherwise once answered."""
    prompt = chat.prompt_ids(messages)
    ids, mask = chat.tokenize([*messages, {"role": "assistant", "content": reference}])
    if ids[: len(prompt)].tolist() != prompt:
        raise ValueError("the chat template renders the prompt differently once it is answered")
    targets = [k for k in range(len(prompt), len(ids)) if mask[k]]
    if not targets:
        raise ValueError("the reference renders to no tokens")
    return ids.tolist(), targets


async def likelihoods(
    url: str,
    model: str,
    chat: ChatFormat,
    rows: list[dict[str, Any]],
    *,
    concurrency: int,
    headers: dict[str, str] | None = None,
    stop: threading.Event | None = None,
    on_reply: Callable[[int], None] | None = None,
) -> list[dict[str, Any] | None]:
    """Each row's reference scored by the model at ``url`` (``.../v1``): {"nll", "tokens"}, the summed
    negative log-likelihood of its tokens given the prompt, from vLLM's prompt log-probabilities (the
    completions API with ``echo``, ``max_tokens`` 0 and ``logprobs`` 0). None for a row the server
    refuses (longer than its context) or the template cannot split; any other failure raises."""
    out: list[dict[str, Any] | None] = [None] * len(rows)
    gate = asyncio.Semaphore(concurrency)
    answered = 0
    async with _client(headers) as client:

        async def one(i: int) -> None:
            nonlocal answered
            try:
                split = reference_tokens(chat, rows[i]["messages"], rows[i]["reference"])
            except (ValueError, ChatTemplateError):
                split = None
            if split is not None:
                ids, targets = split
                async with gate:
                    body = {"model": model, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}
                    async with client.post(f"{url}/completions", json=body) as r:
                        text = await r.read()
                        refused = 400 <= r.status < 500 and r.status not in (401, 403, 404)
                        if r.status != 200 and not refused:
                            what = text[:300].decode(errors="replace")
                            raise RuntimeError(f"sample {i}: HTTP {r.status} from {url}: {what}")
                        if r.status == 200:
                            logprobs = orjson.loads(text)["choices"][0]["logprobs"]["token_logprobs"]
                            out[i] = {"nll": -sum(logprobs[k] for k in targets), "tokens": len(targets)}
            answered += 1
            if on_reply is not None:
                on_reply(answered)

        await _all(one, len(rows), stop)
    return out
