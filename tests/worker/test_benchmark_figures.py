"""A benchmark's figures by `vllm bench serve`'s rules (vllm/benchmarks/lib/endpoint_request_func.py and
calculate_metrics in vllm/benchmarks/serve.py), against recorded streams and hand-worked examples."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import orjson
import pytest
from aiohttp import web

from worker.benchmarks import _request, measure, summarize

# A chat stream as vLLM's OpenAI server sends it: the role first (no text), the text, the finish reason
# (an empty delta), then the usage (no choices). Arrival times (s after sending) are set by hand.
HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
CHAT = [
    (0.20, {**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}),
    (0.25, {**HEAD, "choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}]}),
    (0.40, {**HEAD, "choices": [{"index": 0, "delta": {"content": " world"}, "finish_reason": None}]}),
    (0.45, {**HEAD, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
    (0.50, {**HEAD, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}),
]
# A completion stream whose first chunk's text is empty (a special token), then text, the finish
# reason, the usage.
COMPLETION = [
    (0.20, {"id": "cmpl-1", "choices": [{"index": 0, "text": "", "finish_reason": None}]}),
    (0.30, {"id": "cmpl-1", "choices": [{"index": 0, "text": "a", "finish_reason": None}]}),
    (0.60, {"id": "cmpl-1", "choices": [{"index": 0, "text": "b", "finish_reason": None}]}),
    (0.65, {"id": "cmpl-1", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
    (0.70, {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}),
]


def test_the_first_chunk_with_choices_starts_the_clock_text_or_not():
    chat = measure(0.0, CHAT, chat=True)
    assert chat["ttft"] == pytest.approx(0.20)  # the role chunk, not "Hello" at 0.25
    assert chat["itl"] == pytest.approx([0.05, 0.15, 0.05])  # every later chunk with choices
    assert chat["e2el"] == pytest.approx(0.50)  # a chat's latency runs to its last message, the usage
    assert chat["output_tokens"] == 3 and chat["input_tokens"] == 7
    assert chat["tpot"] == pytest.approx((0.50 - 0.20) / 2)

    completion = measure(0.0, COMPLETION, chat=False)
    assert completion["ttft"] == pytest.approx(0.20)  # the empty-text chunk
    assert completion["itl"] == pytest.approx([0.10, 0.30, 0.05])
    assert completion["e2el"] == pytest.approx(0.65)  # a completion's runs to its last chunk with choices
    assert completion["tpot"] == pytest.approx((0.65 - 0.20) / 2)

    # no chunk with choices: a completion failed; vLLM's chat function counts it, with a TTFT of 0
    usage_only = [COMPLETION[-1]]
    assert "error" in measure(0.0, usage_only, chat=False)
    assert measure(0.0, usage_only, chat=True)["ttft"] == 0.0
    # without usage the chunks with choices are counted
    assert measure(0.0, CHAT[:-1], chat=True)["output_tokens"] == 4


def test_a_recorded_stream_is_read_off_the_wire(tmp_path):
    """The same chat stream served with its gaps (x4, so a loaded machine keeps them apart): the
    request function takes the role chunk's arrival as the first token."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b": a comment line\n\n")
        before = 0.0
        for at, chunk in CHAT:
            await asyncio.sleep(4 * (at - before))
            before = at
            await response.write(b"data:" + orjson.dumps(chunk) + b"\n\n")  # vLLM's spacing varies
        await response.write(b"data: [DONE]\n\n")
        return response

    async def run() -> dict:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # pyright: ignore[reportOptionalMemberAccess]
        try:
            async with aiohttp.ClientSession() as client:
                return await _request(client, f"http://127.0.0.1:{port}", "m", {"messages": []}, 3)
        finally:
            await runner.cleanup()

    result = asyncio.run(run())
    assert 0.8 <= result["ttft"] < 1.0, result  # the role at 0.8 s; "Hello" came at 1.0 s
    assert len(result["itl"]) == 3 and result["e2el"] >= 2.0 and result["output_tokens"] == 3


def request(ttft: float, e2el: float, output: int, itl: list[float]) -> dict:
    return {
        "ttft": ttft,
        "e2el": e2el,
        "itl": itl,
        "tpot": (e2el - ttft) / (output - 1) if output > 1 else None,
        "input_tokens": 10,
        "output_tokens": output,
    }


RESULTS = [
    request(0.1, 0.5, 5, [0.1, 0.1, 0.1, 0.1]),  # TPOT 0.1
    request(0.3, 1.3, 3, [0.4, 0.6]),  # TPOT 0.5
    request(0.2, 0.2, 1, []),  # one token: no TPOT (0 for goodput)
    {"error": "HTTP 500: boom"},
]


def test_each_figure_by_hand():
    level = summarize(RESULTS, 2.0, concurrency=4, request_rate=None)
    assert (level["completed"], level["failed"], level["errors"]) == (3, 1, ["HTTP 500: boom"])
    assert level["request_throughput"] == pytest.approx(1.5) and level["output_throughput"] == pytest.approx(4.5)
    assert level["request_goodput"] is None  # no SLOs given
    # TTFT 100 200 300 ms: the p99 at rank 0.99 x 2 = 1.98, between 200 and 300
    ttft = level["ttft_ms"]
    assert (ttft["mean"], ttft["median"]) == (pytest.approx(200), pytest.approx(200))
    assert ttft["std"] == pytest.approx(math.sqrt((100**2 + 0 + 100**2) / 3))  # numpy's: over n
    assert ttft["percentiles"] == {"p99": pytest.approx(298)}
    # TPOT over the requests of more than one token: 100 and 500 ms
    tpot = level["tpot_ms"]
    assert (tpot["mean"], tpot["median"], tpot["std"]) == (pytest.approx(300), pytest.approx(300), pytest.approx(200))
    assert tpot["percentiles"] == {"p99": pytest.approx(100 + 0.99 * 400)}
    # ITL over every gap of every request: 100 100 100 100 400 600 ms; the p99 at rank 4.95
    itl = level["itl_ms"]
    assert (itl["mean"], itl["median"]) == (pytest.approx(1400 / 6), pytest.approx(100))
    assert itl["percentiles"] == {"p99": pytest.approx(400 + 0.95 * 200)}
    # E2E is not among the default percentile metrics (ttft, tpot, itl)
    assert level["e2el_ms"]["median"] == pytest.approx(500) and level["e2el_ms"]["percentiles"] == {}

    chosen = summarize(
        RESULTS, 2.0, concurrency=4, request_rate=None, percentile_metrics=("e2el",), metric_percentiles=(50, 99.9)
    )
    assert chosen["e2el_ms"]["percentiles"] == {"p50": pytest.approx(500), "p99.9": pytest.approx(500 + 0.998 * 800)}
    assert chosen["ttft_ms"]["percentiles"] == {}


@pytest.mark.parametrize(
    "slo,good",
    [
        ({"ttft": 250, "tpot": 200}, 2),  # the second request's TTFT (300 ms) is over; the third's TPOT counts as 0
        ({"e2el": 500}, 2),  # within means at most: the first request's 500 ms is good
        ({"tpot": 0}, 1),  # only the one-token request
        ({"ttft": 1000, "tpot": 1000, "e2el": 2000}, 3),
    ],
)
def test_goodput_counts_the_requests_within_every_slo(slo, good):
    level = summarize(RESULTS, 2.0, concurrency=4, request_rate=None, goodput=slo)
    assert level["request_goodput"] == pytest.approx(good / 2.0)
