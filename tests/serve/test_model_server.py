"""The built-in model server (`python -m worker.serve`), as a client of a vLLM endpoint sees it:
the OpenAI SDK streaming with usage, greedy replies equal to a cache-free decode of the same model,
seeds, stop strings, batched concurrent requests, vLLM's metrics, and clear errors."""

import asyncio
import functools
import json
import re
import subprocess
import sys
import time

import httpx
import numpy as np
import psutil
import pytest
from openai import OpenAI

from tests.conftest import free_port, run_async
from worker.training.tiny import create_tiny_gemma4

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_gemma4(tmp_path_factory.mktemp("serve") / "tiny")


def start_server(model_dir, log, max_num_seqs: int, max_model_len: int, stats_every_s: float = 10):
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.serve", "--model", str(model_dir), "--served-model-name", MODEL]
            + ["--port", str(port), "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len)]
            + ["--log-stats-interval", str(stats_every_s)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the model server did not become healthy"
        time.sleep(0.3)
    return proc, url


@pytest.fixture(scope="module")
def server_proc(model_dir, tmp_path_factory):
    # The shape the API tests deploy the tiny model at (compiled once for both, from the persistent cache)
    proc, url = start_server(model_dir, tmp_path_factory.mktemp("serve-log") / "server.log", 4, 256)
    yield proc, url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(server_proc):
    return server_proc[1]


def test_the_server_loads_neither_torch_nor_tunixs_trainers(server_proc):
    """An endpoint starts as fast as its imports allow: JAX and Tunix's model code, not torch (which
    tensorboardX, under Tunix's trainers, imports where torch is installed, as it is here) nor pandas
    (Tunix's RL trainers'), seconds of CPU and hundreds of MB each."""
    mapped = {m.path for m in psutil.Process(server_proc[0].pid).memory_maps()}
    assert [p for p in mapped if "/jaxlib/" in p], "a JAX process maps jaxlib"
    assert not [p for p in mapped if "libtorch" in p or "/pandas/" in p]


def metric(url: str, name: str, key: str | None = None) -> float:
    """A sample of the server's /metrics (with its key, when it was started with one)."""
    headers = {"Authorization": f"Bearer {key}"} if key else None
    for line in httpx.get(f"{url}/metrics", headers=headers).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_openai_sdk_streams_a_chat_reply_with_usage(server):
    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == [MODEL]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            seed=7,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["length"], ["stop"]) and text
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens > 5
    assert usage.completion_tokens == 12 if finish == ["length"] else 1 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    # Not streamed: the same reply for the same seed.
    again = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}],
        max_tokens=12,
        seed=7,
    )
    assert again.choices[0].message.content == text and again.usage == usage


@functools.cache
def test_time_to_first_token_counts_from_arrival_to_the_first_text_sent(server):
    """The server's TTFT starts when it sees the request (before reading and parsing it) and ends when
    the first text has been written: so it lies within what the client measures, sending to reading."""
    body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 4, "ignore_eos": True, "stream": True}
    for _ in range(3):
        total, count = (metric(server, f"vllm:time_to_first_token_seconds_{k}") for k in ("sum", "count"))
        with httpx.Client(timeout=60) as client:
            sent = time.perf_counter()
            first = None
            with client.stream("POST", f"{server}/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                        first = time.perf_counter() - sent
        assert metric(server, "vllm:time_to_first_token_seconds_count") == count + 1
        server_ttft = metric(server, "vllm:time_to_first_token_seconds_sum") - total
        assert first is not None and 0 < server_ttft <= first, (server_ttft, first)


def _reference_forward(model_dir: str, width: int):
    """The model's logits for one right-padded sequence of ``width`` tokens, causal mask, no cache."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from worker.training import models

    graphdef, state = nnx.split(models.load_base_model(model_dir, models.resolve_config(model_dir)))
    causal = jnp.tril(jnp.ones((width, width), bool))[None]

    @jax.jit
    def forward(state, tokens):
        return nnx.merge(graphdef, state)(tokens, attention_mask=causal)[0]

    return lambda tokens: forward(state, tokens)


def reference_greedy(model_dir, prompt_ids: list[int], n: int, width: int = 64) -> list[int]:
    """Greedy decoding by running the whole sequence through the model for every token: no cache,
    no left padding, no batching (right padding, which a causal mask keeps out of earlier tokens)."""
    import jax.numpy as jnp

    forward = _reference_forward(str(model_dir), width)
    ids = list(prompt_ids)
    for _ in range(n):
        tokens = np.zeros((1, width), np.int32)
        tokens[0, : len(ids)] = ids
        logits = forward(jnp.asarray(tokens))
        ids.append(int(np.argmax(np.asarray(logits[0, len(ids) - 1]))))
    return ids[len(prompt_ids) :]


def test_greedy_replies_in_a_batch_match_a_cache_free_decode(server, model_dir):
    """Prompts of different lengths decoded together (left padding, the KV cache, sliding-window and
    global layers) give what the model gives each prompt alone, token for token."""
    from worker.chat import ChatFormat

    tok = ChatFormat(model_dir)
    prompts = ["the quick brown fox", "a", "once upon a time in a land far away there lived", "hello world"]

    async def complete(client, prompt):
        r = await client.post(
            f"{server}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        return r.json()

    async def all_at_once():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[complete(client, p) for p in prompts])

    ttft_before = metric(server, "vllm:time_to_first_token_seconds_count")
    tokens_before = metric(server, "vllm:generation_tokens_total")
    replies = run_async(all_at_once())
    for prompt, reply in zip(prompts, replies, strict=True):
        expected = reference_greedy(model_dir, [tok.bos_id, *tok.encode(prompt)], 10)
        stop = next((i for i, t in enumerate(expected) if t in tok.stop_ids), len(expected))
        assert reply["choices"][0]["text"] == tok.decode(expected[:stop], skip_special_tokens=True), prompt
        # vLLM counts the token that ended the reply (check_stop reads it from the output tokens)
        assert reply["usage"]["completion_tokens"] == min(stop + 1, len(expected)), prompt
    assert metric(server, "vllm:time_to_first_token_seconds_count") == ttft_before + len(prompts)
    generated = sum(r["usage"]["completion_tokens"] for r in replies)
    assert metric(server, "vllm:generation_tokens_total") == tokens_before + generated
    assert metric(server, "vllm:num_requests_running") == 0


def test_requests_join_running_ones_and_the_cache_wraps_around(model_dir, tmp_path):
    """Continuous batching: a request that arrives while another decodes joins it at once (its first
    token comes before the other's reply ends), and what each gets is still what the model gives its
    prompt alone, token for token, also across rebases of the cache's columns (every 32 steps here).
    Its output says where it serves, then how busy it is while busy."""
    from worker.chat import ChatFormat

    tok = ChatFormat(model_dir)
    log = tmp_path / "server.log"
    proc, url = start_server(model_dir, log, 4, 128, stats_every_s=0.5)
    # (each prompt's greedy reply must show text for 20 of its tokens: tiny-gemma4's reply to "a" turns into
    # a byte that never completes a character after 14)
    prompts = ["the quick brown fox", "once upon a time in a land far away", "I", "numbers: one two", "hello"]
    n = 60  # each request starts when the one before has 20 tokens
    started = [asyncio.Event() for _ in prompts]

    async def complete(client, i):
        if i:
            await started[i - 1].wait()
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": n, "temperature": 0, "ignore_eos": True}
        text, chunks, first = "", 0, None
        async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and (chunk := json.loads(line[6:]))["choices"]:
                    text += chunk["choices"][0]["text"]
                    chunks += 1
                    first = first or time.perf_counter()
                    if chunks == 20:
                        started[i].set()
        return text, first, time.perf_counter()

    async def overlapping():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[complete(client, i) for i in range(len(prompts))])

    def generation_rates() -> list[float]:
        pattern = r"avg generation throughput: ([\d.]+) tokens/s, running: \d+ reqs, waiting: \d+ reqs"
        return [float(rate) for rate in re.findall(pattern, log.read_text())]

    try:
        replies = run_async(overlapping())
        deadline = time.monotonic() + 10  # the stats line that covers the work comes within its interval
        while not any(generation_rates()) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for i in range(1, len(prompts)):
        assert replies[i][1] < replies[i - 1][2], f"request {i} waited for request {i - 1} to end"
    output = log.read_text()
    assert "tunedeck: KV cache columns rebased" in output
    assert f"tunedeck: serving {MODEL} at {url} (max_num_seqs 4, max_model_len 128)" in output
    assert any(generation_rates()), output[-2000:]
    for prompt, (text, _, _) in zip(prompts, replies, strict=True):
        expected = reference_greedy(model_dir, [tok.bos_id, *tok.encode(prompt)], n, width=128)
        assert text == tok.decode(expected, skip_special_tokens=True), prompt


@pytest.mark.parametrize("advance, place", [(0, 2), (49, 1), (33, 2), (70, 0)])
def test_a_prompt_decodes_as_alone_whatever_the_column_and_row_it_joins_at(model_dir, advance, place):
    """The engine itself: a request that joins after ``advance`` steps of another (so at another shared
    column, across a rebase for 70), in a group, in row ``place``, gets the reference's greedy reply."""
    from worker.chat import ChatFormat
    from worker.serve import generate

    tok = ChatFormat(model_dir)
    engine = generate.Engine(model_dir, max_num_seqs=4, max_model_len=128)
    engine.start(warm_up=False)

    def request(prompt: str, n: int, out: list | None = None):
        ids = [tok.bos_id, *tok.encode(prompt)]
        emit = (lambda token, finish: out.append(token) if token is not None else None) if out is not None else None
        return generate.Request(ids, n, emit or (lambda token, finish: None), temperature=0.0, ignore_eos=True)

    if advance:
        engine._admit([request("x", advance)])
        while any(engine._rows):
            engine._decode()
    prompt = "once upon a time in a land far away there lived"
    out: list[int] = []
    group = [request("a", 12), request("hello", 12)]
    group.insert(place, request(prompt, 12, out))
    engine._admit(group)
    while any(engine._rows):
        engine._decode()
    assert out == reference_greedy(model_dir, [tok.bos_id, *tok.encode(prompt)], 12)


def test_seed_temperature_and_stop(server):
    def complete(**kw):
        body = {"model": MODEL, "prompt": "numbers:", "max_tokens": 16, **kw}
        r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    alone = complete(temperature=1.0, seed=3, max_tokens=48)["text"]
    assert complete(temperature=1.0, seed=3, max_tokens=48)["text"] == alone

    async def beside_others():  # the seeded request in another row, decoded with other rows
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            bodies = [{"model": MODEL, "prompt": f"other {i}:", "max_tokens": 24 + 8 * i} for i in range(4)]
            bodies.insert(2, {"model": MODEL, "prompt": "numbers:", "max_tokens": 48, "temperature": 1.0, "seed": 3})
            replies = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
            return replies[2].json()["choices"][0]["text"]

    assert run_async(beside_others()) == alone
    samples = {complete(temperature=1.0, seed=s)["text"] for s in range(4)}
    assert len(samples) > 1, "different seeds should sample different replies"

    # A stop string ends the reply before it, even where it spans tokens.
    replies = ((s, complete(temperature=1.0, seed=s)["text"]) for s in range(20))
    seed, text = next((s, t) for s, t in replies if len(t) > 8)
    stop = text[4:8]
    stopped = complete(temperature=1.0, seed=seed, stop=["never-there", stop])
    assert stopped == {**stopped, "text": text[: text.find(stop)], "finish_reason": "stop"}
    assert complete(temperature=1.0, seed=seed, max_tokens=2)["finish_reason"] == "length"

    # ignore_eos (vLLM's, for benchmarks): a reply that ended at end-of-sequence goes on to max_tokens.
    def reply(seed: int, **kw) -> dict:
        body = {"model": MODEL, "prompt": "numbers:", "max_tokens": 128, "temperature": 1.0, "seed": seed, **kw}
        return httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()

    # end-of-sequence or end-of-turn is about 2 in 1,100 tokens of the random model: one of these ends early
    seed, ended = next((s, r) for s in range(40) if (r := reply(s))["choices"][0]["finish_reason"] == "stop")
    assert ended["usage"]["completion_tokens"] < 128
    # The end token counts as generated, as in vLLM (its check_stop reads it from the output tokens): a
    # budget of exactly that many tokens still ends at "stop", and a reply that is only its end token
    # reports 1 token, not 0.
    exact = reply(seed, max_tokens=ended["usage"]["completion_tokens"])
    assert (exact["choices"][0]["finish_reason"], exact["usage"]) == ("stop", ended["usage"])
    longer = reply(seed, ignore_eos=True)
    assert longer["usage"]["completion_tokens"] == 128 and longer["choices"][0]["finish_reason"] == "length"
    assert longer["choices"][0]["text"].startswith(ended["choices"][0]["text"])


def test_an_echoed_prompts_logprobs_are_the_models_own(server, model_dir):
    """vLLM's way to score text: `echo` with `max_tokens` 0 and `logprobs` answers the prompt's tokens'
    log-probabilities in OpenAI's completions form: the model's own, as a cache-free forward pass of the
    same checkpoint gives them (the evaluation test checks them against transformers end to end)."""
    from worker.chat import ChatFormat

    tok = ChatFormat(model_dir)
    messages = [
        {"role": "user", "content": "What is the capital of Chad?"},
        {"role": "assistant", "content": "N'Djamena."},
    ]
    ids, _ = tok.tokenize(messages)
    ids = ids.tolist()
    r = httpx.post(
        f"{server}/v1/completions",
        json={"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert lp["tokens"] == [tok.decode([t]) for t in ids] and choice["text"] == tok.decode(ids)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:k]) for k in range(len(ids))]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None

    import jax
    import jax.numpy as jnp

    tokens = np.zeros((1, 64), np.int32)
    tokens[0, : len(ids)] = ids
    expected = np.asarray(jax.nn.log_softmax(_reference_forward(str(model_dir), 64)(jnp.asarray(tokens))[0], axis=-1))
    for k in range(1, len(ids)):
        assert lp["token_logprobs"][k] == pytest.approx(float(expected[k - 1, ids[k]]), abs=2e-4), k
        top = lp["top_logprobs"][k]  # the token itself, and the 2 most likely
        best = np.argsort(-expected[k - 1])[:2]
        want = {tok.decode([ids[k]])} | {tok.decode([int(t)]) for t in best}
        assert set(top) == want and top[tok.decode([ids[k]])] == lp["token_logprobs"][k], (k, top)

    # What the built-in server does not do (vLLM would: generated tokens' logprobs) is refused by name.
    for body, words in [
        ({"prompt": ids, "max_tokens": 4, "logprobs": 1}, "logprobs: this server gives the prompt's"),
        ({"prompt": ids, "max_tokens": 4, "echo": True}, "echo: this server gives"),
        ({"prompt": ids, "max_tokens": 0}, "max_tokens: this server gives"),
        ({"prompt": ids, "max_tokens": 0, "echo": True, "stream": True}, "stream: an echoed prompt's"),
        ({"prompt": [ids[0], 10**9], "max_tokens": 0, "echo": True}, "prompt: token ids are 0 to"),
        ({"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 21}, "logprobs: Input should be less than"),
    ]:
        r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)


def test_bad_requests_are_named(server):
    def post(body):
        return httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)

    r = post({"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = post({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = post({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role"
    r = post({"model": MODEL, "messages": [{"role": "user", "content": "word " * 400}]})
    assert r.status_code == 400 and "maximum context length is 256" in r.json()["error"]["message"]
