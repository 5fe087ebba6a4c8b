"""Thinking on the built-in model server: the chat template's switch comes from the request's
``chat_template_kwargs`` (as vLLM takes it), and what the model writes in its thought channel comes back
as ``reasoning_content``, apart from the answer in ``content`` (as vLLM's reasoning parsers return it).

The model is a Gemma 4 checkpoint laid out like the release whose weights script its greedy reply
(tests/checkpoints.write_scripted_gemma4): it opens the thought channel, thinks "France", closes it,
answers "Paris" and ends its turn. transformers' own greedy decode of it is the reference."""

from __future__ import annotations

import json

import httpx
import pytest

from tests import checkpoints
from tests.serve.test_model_server import MODEL, start_server

SCRIPT = ["<|channel>", "thought\n", "Fran", "ce", "<channel|>", "Par", "is", "<turn|>"]
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    return checkpoints.write_scripted_gemma4(tmp_path_factory.mktemp("scripted") / "gemma-4-scripted-it", SCRIPT)


@pytest.fixture(scope="module")
def url(scripted, tmp_path_factory):
    proc, url = start_server(scripted, tmp_path_factory.mktemp("log") / "server.log", 2, 128)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_the_reference_decode_is_the_script(scripted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(scripted))
    model = AutoModelForCausalLM.from_pretrained(str(scripted), dtype=torch.float32)
    prompt = tok.apply_chat_template(
        ASK["messages"], add_generation_prompt=True, enable_thinking=True, return_dict=True, return_tensors="pt"
    )
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)[0, prompt["input_ids"].shape[1] :]
    assert tok.decode(out) == "".join(SCRIPT)


def test_a_streamed_thought_arrives_as_reasoning_content(url):
    body = {**ASK, "stream": True, "stream_options": {"include_usage": True}}
    body["chat_template_kwargs"] = {"enable_thinking": True}
    deltas, finish, usage, lines = [], None, None, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            lines.append(line)
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                deltas.append(choice["delta"])
                finish = choice["finish_reason"] or finish
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content, finish) == ("France", "Paris", "stop")
    # the thought came first, in its own deltas, never mixed into content
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning_content") and "reasoning_content" in kinds
    assert usage["completion_tokens"] == len(SCRIPT)  # every generated token, the end of turn too (as vLLM)
    # the gateway's time to first token counts from the first thought, as vLLM's benchmark counts any text
    from app.endpoints.gateway import _TOKEN

    first = next(i for i, line in enumerate(lines) if _TOKEN.search(line.encode()))
    assert "reasoning_content" in json.loads(lines[first][6:])["choices"][0]["delta"]
    # the switch reached the template: the prompt has the thinking token in a system turn
    off = httpx.post(f"{url}/v1/chat/completions", json={**ASK, "max_tokens": 1}, timeout=60).json()
    assert usage["prompt_tokens"] > off["usage"]["prompt_tokens"]


def test_a_whole_reply_has_reasoning_content_beside_content(url):
    body = {**ASK, "chat_template_kwargs": {"enable_thinking": True}}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    message = reply["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("France", "Paris")
    assert reply["choices"][0]["finish_reason"] == "stop"
