"""The built-in model server's throughput against concurrency, and its TTFT metric against the client's.

    .venv/bin/python bench/serve.py [--model DIR] [--requests 32] [--max-tokens 64] [--concurrency 1,4,16]

Starts `python -m worker.serve` on the tiny model (made on the fly unless --model is given), then for
each concurrency sends that many streams at a time (``--requests`` in all, random-word prompts,
``max_tokens`` each with ``ignore_eos``) through Tunedeck's benchmark client
(worker/benchmarks.run_level), and reports output tokens/s, and the mean TTFT the client saw (send ->
first chunk with text, as ``vllm bench serve`` counts it) against the mean of the server's
``vllm:time_to_first_token_seconds`` over the same requests (sum/count difference of the histogram).

Goals: output tokens/s grows with concurrency (1 < 4 < 16); server and client TTFT agree within 5 ms.
The script reports; it does not assert.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from worker.benchmarks import run_level  # noqa: E402

WORDS = "the a model token cache batch stream river mountain light quick brown fox jumps over lazy dog".split()
GOAL_TTFT_AGREEMENT_S = 0.005


def ttft_metric(url: str) -> tuple[float, float]:
    """(sum, count) of vllm:time_to_first_token_seconds."""
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        for key in ("sum", "count"):
            if line.startswith(f"vllm:time_to_first_token_seconds_{key}"):
                values[key] = float(line.rsplit(" ", 1)[1])
    return values["sum"], values["count"]


async def level(url: str, model: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    rng = random.Random(concurrency)
    prompts = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))} for _ in range(requests)]
    before = ttft_metric(url)
    result = await run_level(url, model, prompts, output_len=max_tokens, concurrency=concurrency)
    after = ttft_metric(url)
    if result["failed"]:
        raise SystemExit(f"{result['failed']} requests failed: {result['errors']}")
    return {
        "concurrency": concurrency,
        "requests": requests,
        "output_tokens": result["output_tokens"],
        "duration_s": result["duration_s"],
        "output_tokens_per_s": result["output_throughput"],
        "client_mean_ttft_s": result["ttft_ms"]["mean"] / 1000,
        "server_mean_ttft_s": (after[0] - before[0]) / (after[1] - before[1]),
    }


def start_server(model_dir: Path, port: int, max_num_seqs: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.serve", "--model", str(model_dir), "--served-model-name", "bench"]
        + ["--port", str(port), "--max-num-seqs", str(max_num_seqs)],
        cwd=ROOT,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the model server exited with code {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("the model server did not become healthy in 300 s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="an HF checkpoint dir (default: a fresh tiny-gemma4)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--port", type=int, default=8199)
    ap.add_argument("--out", type=Path, default=None, help="write serve.json into this directory")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]

    with tempfile.TemporaryDirectory(prefix="tunedeck-bench-serve-") as tmp:
        model_dir = args.model
        if model_dir is None:
            from worker.training.tiny import create_tiny_gemma4

            model_dir = create_tiny_gemma4(Path(tmp) / "tiny")
        proc = start_server(model_dir, args.port, max(levels))
        try:
            url = f"http://127.0.0.1:{args.port}"
            asyncio.run(level(url, "bench", 1, 2, 4))  # a first request of each kind, untimed
            results = [asyncio.run(level(url, "bench", c, args.requests, args.max_tokens)) for c in levels]
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    print(f"{'concurrency':>11} {'out tok/s':>9} {'client TTFT ms':>14} {'server TTFT ms':>14} {'diff ms':>7}")
    for r in results:
        diff = (r["client_mean_ttft_s"] - r["server_mean_ttft_s"]) * 1000
        print(
            f"{r['concurrency']:11d} {r['output_tokens_per_s']:9.1f} {r['client_mean_ttft_s'] * 1000:14.1f} "
            f"{r['server_mean_ttft_s'] * 1000:14.1f} {diff:7.1f}"
        )
    rates = [r["output_tokens_per_s"] for r in results]
    grows = all(a < b for a, b in zip(rates, rates[1:], strict=False))
    agree = all(abs(r["client_mean_ttft_s"] - r["server_mean_ttft_s"]) <= GOAL_TTFT_AGREEMENT_S for r in results)
    print(
        f"goals: throughput grows with concurrency: {'met' if grows else 'NOT met'}; "
        f"TTFT agreement within {GOAL_TTFT_AGREEMENT_S * 1000:.0f} ms: {'met' if agree else 'NOT met'}"
    )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serve.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
