"""Probing a model server as a client would, and scraping its Prometheus metrics (vLLM's names).

``probe`` sends one small streaming completion and times it the way ``vllm bench serve`` does: TTFT
from sending to the first chunk with text, then the output tokens and the whole duration. ``scrape``
reads ``/metrics``; ``Scraper`` turns two scrapes into rates (mean server-side TTFT and generated
tokens per second since the last one). Both work on any server that speaks vLLM's API, and send the
model server's key (``Authorization: Bearer``) when given one.
"""

import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROBE_PROMPT = "Count to five:"
PROBE_TOKENS = 16


def auth(api_key: str | None) -> dict[str, str]:
    """The headers that carry a model server's key (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def probe(url: str, model: str, api_key: str | None = None, timeout: float = 60.0) -> dict:
    body = {
        "model": model,
        "prompt": PROBE_PROMPT,
        "max_tokens": PROBE_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, tokens, code, error = None, 0, 0, None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth(api_key), timeout=timeout) as r:
            code = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            if code >= 400:
                error = f"HTTP {code}"
    except httpx.HTTPError as exc:
        error = f"probe failed: {exc}"
    return {
        "ttft_s": ttft,
        "duration_s": time.perf_counter() - start,
        "output_tokens": tokens,
        "status_code": code or 599,
        "error": error,
    }


def scrape(url: str, api_key: str | None = None) -> dict[str, float]:
    """The server's metrics, summed over labels: {sample name: value}."""
    r = httpx.get(f"{url}/metrics", headers=auth(api_key), timeout=5)
    r.raise_for_status()
    text = r.text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values


class Scraper:
    """Rates between consecutive scrapes of one server."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url
        self.api_key = api_key
        self.last: tuple[float, dict[str, float]] | None = None

    def __call__(self) -> dict:
        now, values = time.monotonic(), scrape(self.url, self.api_key)
        out = {
            "running": int(values.get("vllm:num_requests_running", 0)),
            "waiting": int(values.get("vllm:num_requests_waiting", 0)),
            "kv_cache_usage": values.get("vllm:kv_cache_usage_perc"),
        }
        if self.last is not None:
            then, before = self.last
            count = values.get("vllm:time_to_first_token_seconds_count", 0) - before.get(
                "vllm:time_to_first_token_seconds_count", 0
            )
            total = values.get("vllm:time_to_first_token_seconds_sum", 0) - before.get(
                "vllm:time_to_first_token_seconds_sum", 0
            )
            generated = values.get("vllm:generation_tokens_total", 0) - before.get("vllm:generation_tokens_total", 0)
            out["server_ttft_s"] = total / count if count > 0 else None
            out["generation_tokens_per_s"] = generated / (now - then) if now > then else None
        self.last = (now, values)
        return out
