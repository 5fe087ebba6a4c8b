"""Many concurrent requests on a web process with one worker thread must not stall.

More requests in flight than pooled DB connections (40) used to deadlock until the pool's 30 s
timeout: requests whose endpoint had returned held connections while waiting for a thread, and
the threads waited for connections.
"""

import asyncio
import time

import httpx
import pytest

from tests.conftest import run_async, start_server, stop_server


@pytest.fixture(scope="module")
def one_thread_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("one-thread"), {"TUNEDECK_WEB_THREADS": "1"})
    yield srv
    stop_server(srv)


def test_more_requests_than_connections_do_not_stall(one_thread_server):
    srv = one_thread_server

    async def burst():
        limits = httpx.Limits(max_connections=100)
        headers = {"Authorization": f"Bearer {srv.admin_token}"}
        async with httpx.AsyncClient(base_url=srv.base_url, headers=headers, limits=limits, timeout=60) as c:
            paths = ["/api/v1/datasets", "/api/v1/pools", "/api/v1/users/me"] * 40
            return await asyncio.gather(*(c.get(p) for p in paths))

    start = time.monotonic()
    responses = run_async(burst())
    elapsed = time.monotonic() - start
    assert [r.status_code for r in responses] == [200] * 120
    # Deadlocked requests wait out the pool's 30 s timeout; a busy machine is slow, never that slow.
    assert elapsed < 25, f"120 requests took {elapsed:.1f}s"
