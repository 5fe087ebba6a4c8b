"""Tunedeck's gateway against the model server behind it: the same load both ways, in one run.

    .venv/bin/python bench/gateway.py [--requests 48] [--concurrency 1,8] [--rounds 3] [--max-tokens 32]
                                      [--data-dir DIR]

Starts `tunedeck up` on a fresh data dir (or DIR, where a merged artifact made by an earlier run of
this script is deployed again instead of training anew), trains the tiny run the tests train (6 steps
on the demo dataset), waits for its merged artifact and deploys it on the cpu pool. Both paths are
warmed with the whole load at every concurrency (so no compilation lands in a measured round). Then,
for each concurrency, rounds of the same requests (random-word prompts, ``ignore_eos``, streamed) go
alternately straight to the model server and through the gateway's ``/v1/completions`` with an API
token, measured as ``vllm bench serve`` measures (worker/benchmarks.run_level). Rounds alternate, and
so does which side goes first, so that drift of this machine hits both alike; a side's p50 TTFT is
the median of its rounds' medians, its throughput their mean. Each side's CPU time per request is
reported too, for the web process and the model server: what the gateway costs the machine, which
on a machine with few cores is throughput the model server loses.

Goals: the gateway adds <= 2 ms to p50 TTFT and costs <= 3% of output throughput. The script reports;
it does not assert.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402

from bench.train_overhead import start_tunedeck  # noqa: E402
from worker.benchmarks import run_level  # noqa: E402

GOAL_TTFT_MS = 2.0
GOAL_THROUGHPUT_LOSS = 0.03
TINY_RUN = {"max_steps": 6, "batch_size": 8, "max_seq_len": 64, "checkpoint_every_steps": 3, "learning_rate": 0.01}
WORDS = "the a model token cache batch stream river mountain light quick brown fox jumps over lazy dog".split()


def wait(what: str, check, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}")


def train_and_merge(api: httpx.Client) -> dict:
    """The tiny run trained and its merged artifact built (or the one built before in this data dir)."""
    for a in api.get("/api/v1/artifacts").json()["data"]:
        if a["kind"] == "merged" and a["status"] == "succeeded":
            return a
    dataset = api.post("/api/v1/datasets/demo").json()["id"]
    wait("the demo dataset", lambda: api.get(f"/api/v1/datasets/{dataset}").json()["status"] == "ready")
    run = api.post("/api/v1/runs", json={"dataset_id": dataset, "config": TINY_RUN}).json()["id"]
    done = ("succeeded", "failed")
    status = wait("the run", lambda: (s := api.get(f"/api/v1/runs/{run}").json()["status"]) in done and s)
    if status != "succeeded":
        raise SystemExit(f"the run {status}")

    def merged():
        arts = api.get("/api/v1/artifacts", params={"run_id": run}).json()["data"]
        return next((a for a in arts if a["kind"] == "merged" and a["status"] in ("succeeded", "failed")), None)

    return wait("the merged artifact", merged)


def deploy(api: httpx.Client) -> dict:
    """The tiny model's merged artifact deployed on the cpu pool: the ready endpoint."""
    artifact = train_and_merge(api)
    if artifact["status"] != "succeeded":
        raise SystemExit(f"the merge failed: {artifact['error']}")
    body = {"artifact_id": artifact["id"], "max_model_len": 512, "max_num_seqs": 16}
    endpoint = api.post("/api/v1/endpoints", json=body).json()["id"]
    return wait(
        "the endpoint",
        lambda: (e := api.get(f"/api/v1/endpoints/{endpoint}").json())["status"] in ("ready", "failed") and e,
    )


def processes(up: psutil.Process, endpoint: dict) -> dict[str, psutil.Process]:
    """The web process under `tunedeck up`, and the endpoint's model server (found by its port)."""
    port = endpoint["url"].rsplit(":", 1)[1]
    web = next(p for p in up.children() if " web" in " ".join(p.cmdline()))
    serve = next(
        p
        for p in psutil.process_iter(["cmdline"])
        if "worker.serve" in (p.info["cmdline"] or []) and port in (p.info["cmdline"] or [])
    )
    return {"web": web, "model server": serve}


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48, help="requests per round")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per side and concurrency, alternating")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--data-dir", type=Path, help="keep the data here; a merged artifact already in it is reused")
    args = ap.parse_args(argv)

    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="tunedeck-bench-gateway-"))
    # no probes in the measured traffic
    server, base, token = start_tunedeck(data_dir, {"TUNEDECK_PROBE_SECONDS": "3600"})
    api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    endpoint = None
    try:
        t0 = time.perf_counter()
        endpoint = deploy(api)
        if endpoint["status"] != "ready":
            raise SystemExit(f"the endpoint failed: {endpoint['error']}")
        print(f"trained, merged and deployed the tiny model in {time.perf_counter() - t0:.0f}s ({data_dir})")

        rng = random.Random(0)
        words = [[rng.choice(WORDS) for _ in range(rng.randint(8, 40))] for _ in range(args.requests)]
        prompts = [{"prompt": " ".join(w)} for w in words]
        sides = {
            "direct": (endpoint["url"], None),
            "gateway": (base, {"Authorization": f"Bearer {token}"}),
        }
        model = endpoint["model"]
        levels = [int(c) for c in args.concurrency.split(",")]
        for url, headers in sides.values():  # warm both paths, and the model server at every shape to come
            for concurrency in levels:
                asyncio.run(
                    run_level(url, model, prompts, output_len=args.max_tokens, concurrency=concurrency, headers=headers)
                )

        procs = processes(psutil.Process(server.pid), endpoint)
        print(
            f"{'concurrency':>11} {'side':<8} {'p50 TTFT ms':>11} {'out tok/s':>9}"
            f" {'web CPU ms/req':>14} {'server CPU ms/req':>17}"
        )
        verdicts = []
        for concurrency in levels:
            ttfts = {side: [] for side in sides}
            rates = {side: [] for side in sides}
            cpu = {side: dict.fromkeys(procs, 0.0) for side in sides}
            for round_ in range(args.rounds):
                for side, (url, headers) in sorted(sides.items(), reverse=round_ % 2 == 1):  # who goes first alternates
                    before = {name: cpu_s(p) for name, p in procs.items()}
                    level = asyncio.run(
                        run_level(
                            url, model, prompts, output_len=args.max_tokens, concurrency=concurrency, headers=headers
                        )
                    )
                    if level["failed"]:
                        raise SystemExit(f"{side}: {level['failed']} requests failed: {level['errors']}")
                    for name, p in procs.items():
                        cpu[side][name] += cpu_s(p) - before[name]
                    ttfts[side].append(level["ttft_ms"]["median"])
                    rates[side].append(level["output_throughput"])
            p50 = {side: float(np.median(v)) for side, v in ttfts.items()}
            tput = {side: float(np.mean(v)) for side, v in rates.items()}
            n = args.rounds * len(prompts)
            per_request = {side: {name: 1000 * v / n for name, v in c.items()} for side, c in cpu.items()}
            for side in sides:
                print(
                    f"{concurrency:>11} {side:<8} {p50[side]:>11.1f} {tput[side]:>9.1f}"
                    f" {per_request[side]['web']:>14.2f} {per_request[side]['model server']:>17.2f}"
                )
            added = p50["gateway"] - p50["direct"]
            loss = 1 - tput["gateway"] / tput["direct"]
            ok = added <= GOAL_TTFT_MS and loss <= GOAL_THROUGHPUT_LOSS
            verdicts.append(ok)
            print(
                f"{'':>11} gateway adds {added:+.1f} ms to p50 TTFT (goal <= {GOAL_TTFT_MS:.0f}), "
                f"throughput {-loss:+.1%} (goal >= -{GOAL_THROUGHPUT_LOSS:.0%}): {'met' if ok else 'NOT met'}"
            )
        print(f"goals: {'met at every concurrency' if all(verdicts) else 'NOT met'}")
    finally:
        if endpoint is not None:  # its model server outlives `tunedeck up` by design: stop it first
            api.post(f"/api/v1/endpoints/{endpoint['id']}/stop")
            wait(
                "the endpoint to stop",
                lambda: api.get(f"/api/v1/endpoints/{endpoint['id']}").json()["status"] in ("stopped", "failed"),
                60,
            )
        server.terminate()
        server.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
