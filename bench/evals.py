"""An evaluation's throughput against the same prompts sent straight to the model server.

    .venv/bin/python bench/evals.py [--model DIR] [--samples 64] [--max-tokens 16] [--concurrency 8] [--rounds 5]

Starts `python -m worker.serve` on the tiny model (made on the fly unless --model is given) and asks it
the demo set's first ``--samples`` prompts (the messages before each last reply), greedily, two ways,
``--concurrency`` requests in flight each:

- baseline: a plain aiohttp loop posting each prompt to /v1/chat/completions and keeping the reply;
- evaluation: what an evaluation does per subject once it is served: `worker.evaluations.ask` (with
  its progress callback) and then every reply scored with exact match, chrF and ROUGE-L
  (`app.evaluations.metrics.score`).

The two alternate for ``--rounds`` rounds; samples/s is the median of each. Goal: the evaluation's at
least 0.9 of the baseline's (it keeps the server batched: requests in flight at once, not one at a
time). Serving a checkpoint (its merge and the server's start) and writing the rows come on top, once
per subject, and are not what this measures. The script reports; it does not assert.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from app.datasets.demo import demo_conversations  # noqa: E402
from app.evaluations.metrics import score  # noqa: E402
from bench.serve import start_server  # noqa: E402
from worker.evaluations import ask  # noqa: E402

GOAL = 0.9
METRICS = ["exact_match", "chrf", "rouge_l"]


async def baseline(url: str, prompts: list[list[dict]], max_tokens: int, concurrency: int) -> list[str]:
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as client:

        async def one(messages: list[dict]) -> str:
            async with gate:
                body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
                async with client.post(f"{url}/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                    return (await r.json())["choices"][0]["message"]["content"] or ""

        return await asyncio.gather(*(one(m) for m in prompts))


def evaluation(url: str, prompts: list[list[dict]], references: list[str], max_tokens: int, concurrency: int):
    answered = []
    replies = asyncio.run(
        ask(f"{url}/v1", "bench", prompts, max_tokens=max_tokens, concurrency=concurrency, on_reply=answered.append)
    )
    return [score(r, ref, METRICS) for r, ref in zip(replies, references, strict=True)], replies


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="an HF checkpoint dir (default: a fresh tiny-gemma4)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--port", type=int, default=8198)
    args = ap.parse_args(argv)

    conversations = [c for c in demo_conversations() if c[-1]["role"] == "assistant"][: args.samples]
    prompts = [c[:-1] for c in conversations]
    references = [c[-1]["content"] for c in conversations]
    with tempfile.TemporaryDirectory(prefix="tunedeck-bench-evals-") as tmp:
        model_dir = args.model
        if model_dir is None:
            from worker.training.tiny import create_tiny_gemma4

            model_dir = create_tiny_gemma4(Path(tmp) / "tiny")
        proc = start_server(model_dir, args.port, args.concurrency)
        url = f"http://127.0.0.1:{args.port}"
        try:
            # Untimed: the server compiles its programs for the batch sizes and lengths these prompts bring
            asyncio.run(baseline(url, prompts, args.max_tokens, args.concurrency))
            direct, evaluated = [], []
            for _ in range(args.rounds):
                started = time.perf_counter()
                first = asyncio.run(baseline(url, prompts, args.max_tokens, args.concurrency))
                direct.append(len(prompts) / (time.perf_counter() - started))
                started = time.perf_counter()
                _, replies = evaluation(url, prompts, references, args.max_tokens, args.concurrency)
                evaluated.append(len(prompts) / (time.perf_counter() - started))
                if replies != first:  # greedy: the same replies both ways, or the comparison means nothing
                    print("warning: the evaluation's replies differ from the baseline's", file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    base, ours = statistics.median(direct), statistics.median(evaluated)
    print(f"samples {len(prompts)}, max_tokens {args.max_tokens}, concurrency {args.concurrency}")
    print(f"baseline (straight to the server): {base:8.2f} samples/s  rounds {[round(x, 2) for x in direct]}")
    print(f"evaluation (ask + score):          {ours:8.2f} samples/s  rounds {[round(x, 2) for x in evaluated]}")
    ratio = ours / base
    print(f"ratio {ratio:.3f}; goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
