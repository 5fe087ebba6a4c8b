"""Tunedeck's gateway against the model server behind it: the same load both ways, in one run.

    .venv/bin/python bench/gateway.py [--requests 48] [--concurrency 1,8] [--rounds 6] [--max-tokens 32]
                                      [--cores split|shared] [--data-dir DIR]

Starts `tunedeck up` on a fresh data dir (or DIR, where a merged artifact made by an earlier run of
this script is deployed again instead of training anew), trains the tiny run the tests train (6 steps
on the demo dataset), waits for its merged artifact and deploys it on the cpu pool. Then, for
each concurrency, rounds of the same requests (random-word prompts, ``ignore_eos``, streamed) go to
three sides in turn: straight to the model server, through the gateway's ``/v1/completions`` with an
API token, and through a bare relay (bench/relay.py: uvicorn + aiohttp and nothing else), measured as
``vllm bench serve`` measures (worker/benchmarks.run_level). The relay tells what any relay hop costs
on this machine apart from what the gateway adds to it. All sides are warmed with the whole load at
every concurrency first (so no compilation lands in a measured round); each round shuffles the
sides' order, so that drift of this machine hits them alike; a side's p50 TTFT is the median of its
rounds' medians, its throughput their mean. Each side's CPU time per request is
reported too, for the web process (the gateway) and the model server.

Cores are split by default (`--cores split`), as a deployment splits them: the model server has its
own host (a TPU VM's accelerator and cores) and the gateway runs in the web process elsewhere. Here
the model server's threads are pinned to the upper half of this machine's cores and every other
process (web, workers, the relay, this load generator) to the lower half. Shared cores (`--cores shared`) make
the gateway's CPU time throughput the model server loses, which on a machine of a few cores measures
the machine as much as the gateway.

Goals: the gateway adds <= 2 ms to p50 TTFT and costs <= 3% of output throughput. The script reports;
it does not assert.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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


def split_cores(up: psutil.Process, relay: psutil.Process, server: psutil.Process) -> str:
    """The model server's threads on the upper half of the cores, every other process's on the lower."""
    cores = sorted(os.sched_getaffinity(0))
    low, high = cores[: max(1, len(cores) // 2)], cores[max(1, len(cores) // 2) :] or cores[-1:]
    others = [up, *up.children(recursive=True), relay, psutil.Process()]
    for proc, mask in [*((p, low) for p in others if p.pid != server.pid), (server, high)]:
        for thread in proc.threads():  # a mask is per thread; threads started later inherit their starter's
            os.sched_setaffinity(thread.id, mask)
    return f"model server on cores {_span(high)}; web, workers, relay and load on cores {_span(low)}"


def _span(cores: list[int]) -> str:
    return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])


def start_relay(upstream: str, api_key: str) -> tuple[subprocess.Popen, str]:
    """bench/relay.py in its own uvicorn, forwarding to ``upstream`` with its key: (its process, its URL)."""
    port = 18000 + random.randrange(1000)
    relay = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "bench.relay:app", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT,
        env={**os.environ, "UPSTREAM": upstream, "UPSTREAM_API_KEY": api_key},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait("the relay", lambda: _answers(f"{url}/health"), 60)
    except SystemExit:
        relay.terminate()
        raise
    return relay, url


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48, help="requests per round")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per side and concurrency")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--cores", choices=("split", "shared"), default="split", help="see above")
    ap.add_argument("--data-dir", type=Path, help="keep the data here; a merged artifact already in it is reused")
    args = ap.parse_args(argv)

    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="tunedeck-bench-gateway-"))
    # no probes in the measured traffic
    server, base, token = start_tunedeck(data_dir, {"TUNEDECK_PROBE_SECONDS": "3600"})
    api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    endpoint = relay = None
    try:
        t0 = time.perf_counter()
        endpoint = deploy(api)
        if endpoint["status"] != "ready":
            raise SystemExit(f"the endpoint failed: {endpoint['error']}")
        print(f"trained, merged and deployed the tiny model in {time.perf_counter() - t0:.0f}s ({data_dir})")
        procs = processes(psutil.Process(server.pid), endpoint)
        # the model server's key, from its environment (this user's process): the direct side sends it, as
        # the gateway and the relay do
        key = procs["model server"].environ()["VLLM_API_KEY"]
        relay, relay_url = start_relay(endpoint["url"], key)

        rng = random.Random(0)
        words = [[rng.choice(WORDS) for _ in range(rng.randint(8, 40))] for _ in range(args.requests)]
        prompts = [{"prompt": " ".join(w)} for w in words]
        sides = {
            "direct": (endpoint["url"], {"Authorization": f"Bearer {key}"}),
            "gateway": (base, {"Authorization": f"Bearer {token}"}),
            "relay": (relay_url, None),
        }
        model = endpoint["model"]
        levels = [int(c) for c in args.concurrency.split(",")]

        def level(side: str, concurrency: int) -> dict:
            url, headers = sides[side]
            result = asyncio.run(
                run_level(url, model, prompts, output_len=args.max_tokens, concurrency=concurrency, headers=headers)
            )
            if result["failed"]:
                raise SystemExit(f"{side}: {result['failed']} requests failed: {result['errors']}")
            return result

        for side in sides:  # warm every path, and the model server at every shape to come
            for concurrency in levels:
                level(side, concurrency)

        if args.cores == "split":
            print(split_cores(psutil.Process(server.pid), psutil.Process(relay.pid), procs["model server"]))
        else:
            print(f"all processes share the {os.cpu_count()} cores")
        print(
            f"{'concurrency':>11} {'side':<8} {'p50 TTFT ms':>11} {'out tok/s':>9}"
            f" {'web CPU ms/req':>14} {'server CPU ms/req':>17}"
        )
        verdicts = []
        for concurrency in levels:
            ttfts = {side: [] for side in sides}
            rates = {side: [] for side in sides}
            cpu = {side: dict.fromkeys(procs, 0.0) for side in sides}
            for _ in range(args.rounds):
                for side in rng.sample(list(sides), len(sides)):  # a new order each round
                    before = {name: cpu_s(p) for name, p in procs.items()}
                    result = level(side, concurrency)
                    for name, p in procs.items():
                        cpu[side][name] += cpu_s(p) - before[name]
                    ttfts[side].append(result["ttft_ms"]["median"])
                    rates[side].append(result["output_throughput"])
            p50 = {side: float(np.median(v)) for side, v in ttfts.items()}
            tput = {side: float(np.mean(v)) for side, v in rates.items()}
            n = args.rounds * len(prompts)
            per_request = {side: {name: 1000 * v / n for name, v in c.items()} for side, c in cpu.items()}
            for side in sides:
                print(
                    f"{concurrency:>11} {side:<8} {p50[side]:>11.1f} {tput[side]:>9.1f}"
                    f" {per_request[side]['web']:>14.2f} {per_request[side]['model server']:>17.2f}"
                )
            added = {side: p50[side] - p50["direct"] for side in sides}
            loss = {side: 1 - tput[side] / tput["direct"] for side in sides}
            ok = added["gateway"] <= GOAL_TTFT_MS and loss["gateway"] <= GOAL_THROUGHPUT_LOSS
            verdicts.append(ok)
            print(
                f"{'':>11} gateway adds {added['gateway']:+.1f} ms to p50 TTFT (goal <= {GOAL_TTFT_MS:.0f}), "
                f"throughput {-loss['gateway']:+.1%} (goal >= -{GOAL_THROUGHPUT_LOSS:.0%}): "
                f"{'met' if ok else 'NOT met'}; a bare relay adds {added['relay']:+.1f} ms, "
                f"throughput {-loss['relay']:+.1%}"
            )
        print(f"goals: {'met at every concurrency' if all(verdicts) else 'NOT met'}")
    finally:
        if relay is not None:
            relay.terminate()
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
