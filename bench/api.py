"""API latency with 10,000 datasets in the database, 50 concurrent clients.

Seeds the datasets straight into a fresh SQLite database, starts the real web app
(`tunedeck web`), and drives the list and detail routes with 50 concurrent keep-alive clients
for a fixed time, two ways in the same run:
  - paced: each client sends a request, waits for the answer, then thinks 200 ms on average
    (50 clients x ~5 requests/s: a very busy team's dashboards and scripts); the clients start
    spread over one think time, as independent users do. Goal: p99 < 50 ms, no errors.
  - saturating: no think time: the ceiling (requests/s) and the latency at it.
Each client opens its connection with one untimed request first. The load generator is a
minimal HTTP/1.1 client so that it costs far less CPU than the server it measures (it shares
the machine's cores with it).

    .venv/bin/python bench/api.py [--datasets 10000] [--clients 50] [--seconds 15] [--think-ms 200]
"""

import argparse
import asyncio
import gc
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def seed(n: int, token: str) -> list[str]:
    from sqlmodel import select

    from app.auth.models import User
    from app.cli import prepare
    from app.core.db import session_scope
    from app.core.security import new_id
    from app.datasets.models import Dataset, DatasetStatus

    prepare()
    stats = {"rows": 100, "tokens": {"min": 10, "median": 50, "p95": 90, "max": 120, "mean": 52}}
    ids = []
    with session_scope() as session:
        admin = session.exec(select(User)).first()
        for i in range(n):
            ds_id = new_id("ds")
            ids.append(ds_id)
            session.add(
                Dataset(
                    id=ds_id,
                    owner_id=admin.id,
                    filename=f"set-{i}.jsonl",
                    bytes=1000 + i,
                    sha256="0" * 64,
                    storage_key=f"datasets/{ds_id}/data",
                    status=DatasetStatus.ready,
                    rows=100,
                    valid_rows=100,
                    stats=stats,
                    preview=[{"line": 1, "messages": [{"role": "user", "content": "hello " * 20}]}],
                    file_type="jsonl",
                    format="chat",
                )
            )
            if i % 1000 == 999:
                session.commit()
        session.commit()
    return ids


class RawClient:
    """A minimal keep-alive HTTP/1.1 GET client on asyncio streams.

    httpx costs about as much CPU per request as the server does, and on a small machine the
    load generator would then measure itself. This one costs a few tens of microseconds.
    """

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port, self.token = host, port, token
        self.reader = self.writer = None

    async def get(self, path: str) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {self.token}\r\n\r\n".encode()
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await self.reader.readexactly(length)
        return status

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def drive(host: str, port: int, token: str, ids: list[str], clients: int, seconds: float, think: float):
    latencies = {"list": [], "detail": []}
    errors = 0
    connected = 0
    ready = asyncio.Event()
    deadline = 0.0

    async def client(k: int):
        nonlocal errors, connected, deadline
        rng = random.Random(k)
        c = RawClient(host, port, token)
        # Connect first, untimed: 50 connections opened in the same instant would otherwise be
        # the whole p99 (each client's first request), and they are a one-off per client.
        await c.get("/api/v1/users/me")
        connected += 1
        if connected == clients:
            deadline = time.perf_counter() + seconds
            ready.set()
        await ready.wait()
        if think:  # independent users: spread the first requests over one think time
            await asyncio.sleep(think * rng.random())
        try:
            while time.perf_counter() < deadline:
                kind = "list" if rng.random() < 0.5 else "detail"
                url = (
                    f"/api/v1/datasets?limit=20&offset={rng.randrange(0, 200)}"
                    if kind == "list"
                    else f"/api/v1/datasets/{rng.choice(ids)}"
                )
                t0 = time.perf_counter()
                try:
                    ok = await c.get(url) == 200
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    ok = False
                    await c.close()
                    c = RawClient(host, port, token)
                latencies[kind].append(time.perf_counter() - t0)
                errors += not ok
                if think:
                    await asyncio.sleep(think * rng.uniform(0.5, 1.5))
        finally:
            await c.close()

    await asyncio.gather(*(client(k) for k in range(clients)))
    return latencies, errors


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--datasets", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--think-ms", type=float, default=200)
    args = ap.parse_args()

    data_dir = Path(tempfile.mkdtemp(prefix="tunedeck-bench-api-"))
    token = "td_bench_" + os.urandom(8).hex()
    os.environ.update(
        TUNEDECK_DATA_DIR=str(data_dir), TUNEDECK_ADMIN_TOKEN=token, TUNEDECK_ADMIN_PASSWORD="bench-password"
    )
    t0 = time.perf_counter()
    ids = seed(args.datasets, token)
    print(f"seeded {len(ids)} datasets in {time.perf_counter() - t0:.1f}s ({data_dir})")

    port = 18000 + random.randrange(1000)
    env = {**os.environ, "TUNEDECK_PORT": str(port)}
    web = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "web", "--no-migrate"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        asyncio.run(drive("127.0.0.1", port, token, ids, 5, 2, 0))  # warm-up
        gc.collect()
        gc.freeze()  # the load generator's own pauses must not count as server latency
        print(f"{'load':<12} {'route':<7} {'requests':>9} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
        for name, think in (("paced", args.think_ms / 1000), ("saturating", 0.0)):
            lat, errors = asyncio.run(drive("127.0.0.1", port, token, ids, args.clients, args.seconds, think))
            for route in ("list", "detail"):
                v = lat[route]
                print(
                    f"{name:<12} {route:<7} {len(v):>9} {len(v) / args.seconds:>7.0f} {pct(v, 0.5):>8.1f} "
                    f"{pct(v, 0.99):>8.1f} {errors:>7}"
                )
            if name == "paced":
                worst = max(pct(lat["list"], 0.99), pct(lat["detail"], 0.99))
                print(
                    f"  goal p99 < 50 ms with no errors: p99 {worst:.1f} ms, {errors} errors -> "
                    f"{'met' if worst < 50 and not errors else 'NOT met'}"
                )
    finally:
        web.terminate()
        web.wait()


if __name__ == "__main__":
    main()
