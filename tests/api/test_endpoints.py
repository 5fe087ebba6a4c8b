"""Endpoints: a merged artifact deployed on the cpu pool reaches `ready` and answers the OpenAI SDK,
straight with the model server's own key (and to no one without it) and through Tunedeck's
authenticated gateway (which records each request's TTFT and tokens); a model server that dies is
noticed with its exit reason; stopping frees the process and its port; only admins see where a model
server listens; bad requests are named."""

import json
import os
import signal
import socket
import subprocess
import time
from datetime import UTC, datetime, timedelta
from urllib.parse import urlparse

import httpx
import psutil
import pytest
import sqlalchemy as sa
from openai import AuthenticationError, NotFoundError, OpenAI
from sqlmodel import Session

from app.endpoints.models import EndpointSample, EndpointStatus, Runtime
from app.models import Endpoint  # with every table, so that the row's foreign keys resolve
from tests.conftest import login, make_user
from tests.serve.test_model_server import metric


def deploy(server, api, artifact) -> dict:
    r = api.post("/api/v1/endpoints", json={"artifact_id": artifact["id"], "max_model_len": 256, "max_num_seqs": 4})
    assert r.status_code == 201, r.text
    assert r.json()["status"] == "pending" and r.json()["model"] == artifact["name"]
    return wait_endpoint(server, api, r.json()["id"], ("ready", "failed"))


def wait_endpoint(server, api, endpoint_id: str, statuses: tuple[str, ...], timeout: float = 240) -> dict:
    def reached():
        e = api.get(f"/api/v1/endpoints/{endpoint_id}").json()
        return e if e["status"] in statuses else None

    return server.wait_for(reached, timeout=timeout, interval=0.3, what=f"endpoint {endpoint_id} {statuses}")


def model_server(endpoint: dict) -> psutil.Process:
    port = str(urlparse(endpoint["url"]).port)
    (proc,) = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "worker.serve" in (p.info["cmdline"] or []) and port in (p.info["cmdline"] or [])
    ]
    return proc


def test_deploy_chat_kill_and_stop(server, api, artifact):
    endpoint = deploy(server, api, artifact)
    assert endpoint["status"] == "ready", (endpoint["error"], server.log()[-3000:])
    assert endpoint["ready_at"] and endpoint["phase"] is None

    # The model server answers only the bearer of its key, which it was given in its environment (not on
    # its command line, which any user of the host can read). Without it, it refuses as vLLM refuses.
    proc = model_server(endpoint)
    key = proc.environ().get("VLLM_API_KEY")
    assert key and len(key) >= 32 and key not in " ".join(proc.cmdline())
    stranger = OpenAI(base_url=endpoint["url"] + "/v1", api_key="td_wrong", max_retries=0)
    with pytest.raises(AuthenticationError):
        stranger.models.list()
    with pytest.raises(AuthenticationError):
        stranger.chat.completions.create(model=artifact["name"], messages=[{"role": "user", "content": "hi"}])
    refused = httpx.post(f"{endpoint['url']}/v1/completions", json={"model": artifact["name"], "prompt": "hi"})
    assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
    assert httpx.get(f"{endpoint['url']}/metrics").status_code == 401
    assert httpx.get(f"{endpoint['url']}/health").status_code == 200  # liveness stays open, as vLLM's

    client = OpenAI(base_url=endpoint["url"] + "/v1", api_key=key)
    assert [m.id for m in client.models.list()] == [artifact["name"]]
    chunks = list(
        client.chat.completions.create(
            model=artifact["name"],
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens >= 1

    # Through the gateway, with a Tunedeck token: listed, streamed, usage reported, and recorded.
    gateway = OpenAI(base_url=f"{server.base_url}/v1", api_key=server.admin_token)
    assert artifact["name"] in [m.id for m in gateway.models.list()]
    chunks = list(
        gateway.chat.completions.create(
            model=artifact["name"],
            messages=[{"role": "user", "content": "hello again"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage.completion_tokens >= 1 and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    # A token the web process has not seen yet goes through the routes (which look it up); once seen,
    # its requests take the gateway's fast path. Both relay the same, and both are counted.
    fresh = OpenAI(
        base_url=f"{server.base_url}/v1", api_key=api.post("/api/v1/tokens", json={"name": "gw"}).json()["token"]
    )
    replies = [
        fresh.completions.create(
            model=artifact["name"], prompt="one two", max_tokens=3, extra_body={"ignore_eos": True}
        )
        for _ in range(2)
    ]
    assert [r.usage.completion_tokens for r in replies] == [3, 3]
    counted = server.anonymous().get("/metrics").text
    line = 'tunedeck_http_requests_total{method="POST",route="/v1/completions",status="200"} '
    assert float(counted.split(line, 1)[1].split("\n", 1)[0]) >= 2, "the gateway's requests must be counted"

    def gateway_samples(endpoint_id):  # written in batches, within half a second of the reply's end
        return [s for s in api.get(f"/api/v1/endpoints/{endpoint_id}/samples").json() if s["source"] == "gateway"]

    samples = server.wait_for(
        lambda: (s := gateway_samples(endpoint["id"])) and len(s) == 3 and s, timeout=10, what="the gateway's samples"
    )
    assert [s["status_code"] for s in samples] == [200] * 3 and not any(s["error"] for s in samples)
    chat = min(samples, key=lambda s: s["at"])
    assert chat["output_tokens"] == usage.completion_tokens and 0 < chat["ttft_s"] <= chat["duration_s"]
    assert sorted(s["output_tokens"] for s in samples if s is not chat) == [3, 3]

    # A client that leaves mid-reply: the gateway lets the model server know, which stops generating.
    generated = metric(endpoint["url"], "vllm:generation_tokens_total", key)
    long = 200
    stream = gateway.chat.completions.create(
        model=artifact["name"],
        messages=[{"role": "user", "content": "a long story"}],
        max_tokens=long,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    stream.close()
    server.wait_for(
        lambda: metric(endpoint["url"], "vllm:num_requests_running", key) == 0, timeout=10, what="the abort"
    )
    assert metric(endpoint["url"], "vllm:generation_tokens_total", key) - generated < long / 2
    quiet = datetime.now(UTC)  # nothing else runs on the model server from here

    # The prober (every second here) times a small request and scrapes vLLM's metrics. A probe taken
    # before `quiet` may have seen the requests above running, so the one looked at comes after it.
    def probed_since_quiet():
        probes = [
            s
            for s in api.get(f"/api/v1/endpoints/{endpoint['id']}/samples").json()
            if s["source"] == "probe" and datetime.fromisoformat(s["at"]) > quiet
        ]
        return probes or None

    probe = server.wait_for(probed_since_quiet, timeout=30, what="a probe once the model server is quiet")[-1]
    assert probe["error"] is None and probe["output_tokens"] >= 1 and probe["ttft_s"] > 0, probe
    assert probe["server_ttft_s"] > 0 and probe["generation_tokens_per_s"] > 0 and probe["running"] == 0, probe
    r = OpenAI(base_url=f"{server.base_url}/v1", api_key="td_wrong").with_options(max_retries=0)
    with pytest.raises(AuthenticationError):
        r.models.list()
    with pytest.raises(NotFoundError, match="not deployed"):
        gateway.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])

    # An artifact being served cannot be deleted.
    assert api.delete(f"/api/v1/artifacts/{artifact['id']}").status_code == 409

    # The model server dies: the endpoint fails, saying how.
    os.kill(model_server(endpoint).pid, signal.SIGKILL)
    failed = wait_endpoint(server, api, endpoint["id"], ("failed",), timeout=60)
    assert "killed by SIGKILL" in failed["error"], failed

    # Another one, stopped: its process ends and its port is free again.
    second = deploy(server, api, artifact)
    assert second["status"] == "ready", second["error"]
    # The gateway still remembers the dead one (for the whole session here): it finds the new one at once.
    reply = gateway.chat.completions.create(
        model=artifact["name"],
        messages=[{"role": "user", "content": "still there?"}],
        max_tokens=3,
        extra_body={"ignore_eos": True},  # sampled: the tiny model may end its reply before any token
    )
    assert reply.usage.completion_tokens >= 1
    samples = server.wait_for(lambda: gateway_samples(second["id"]), timeout=10, what="the gateway's sample")
    assert [s["status_code"] for s in samples] == [200]
    proc = model_server(second)
    assert api.delete(f"/api/v1/endpoints/{second['id']}").status_code == 409  # still serving
    assert api.post(f"/api/v1/endpoints/{second['id']}/stop").json()["status"] == "stopping"
    stopped = wait_endpoint(server, api, second["id"], ("stopped",), timeout=60)
    assert stopped["stopped_at"]
    with pytest.raises(psutil.NoSuchProcess):
        proc.status()  # the model server's process is gone
    url = urlparse(second["url"])
    with socket.socket() as s:
        assert s.connect_ex((url.hostname, url.port)) != 0, "the port should be closed"
    serving = [e for e in api.get("/api/v1/endpoints").json()["data"] if e["model"] == artifact["name"]]
    if not [e for e in serving if e["status"] == "ready"]:  # (other tests may deploy it too)
        with pytest.raises(NotFoundError, match="not deployed"):
            gateway.chat.completions.create(model=artifact["name"], messages=[{"role": "user", "content": "hi"}])
    assert api.delete(f"/api/v1/endpoints/{second['id']}").status_code == 204
    assert api.get(f"/api/v1/endpoints/{second['id']}").status_code == 404
    listed = api.get("/api/v1/endpoints", params={"artifact_id": artifact["id"]}).json()["data"]
    assert endpoint["id"] in [e["id"] for e in listed] and second["id"] not in [e["id"] for e in listed]
    assert {e["artifact_id"] for e in listed} == {artifact["id"]}  # other tests deploy it too


def stopped_endpoint(server, endpoint_id: str, owner_id: int, artifact: dict, **values) -> str:
    """A stopped endpoint of the artifact on the cpu pool, made in the database (no model server)."""
    engine = sa.create_engine(server.env.get("TUNEDECK_DATABASE_URL") or f"sqlite:///{server.data_dir}/tunedeck.db")
    with Session(engine) as s:
        s.add(
            Endpoint(
                id=endpoint_id,
                owner_id=owner_id,
                artifact_id=artifact["id"],
                model=artifact["name"],
                pool="cpu",
                runtime=Runtime.local,
                status=EndpointStatus.stopped,
                settings={"max_model_len": 256, "max_num_seqs": 4},
                **values,
            )
        )
        s.commit()
    engine.dispose()
    return endpoint_id


def test_only_admins_see_where_a_model_server_listens(server, api, artifact):
    """A member's endpoint shows no model server address: not in the API (one, the list, the live
    stream) nor on its page. The row is made in the database (a deploy of the member's own would train,
    merge and start a model server only to be looked at); the admin's own endpoints show their url
    (test_deploy_chat_kill_and_stop)."""
    username, password, token = make_user(server)
    member = server.client(token)
    owner = member.get("/api/v1/users/me").json()["id"]
    endpoint_id = stopped_endpoint(server, f"ep-member-{username[-8:]}", owner, artifact, url="http://10.7.0.3:39123")

    one = member.get(f"/api/v1/endpoints/{endpoint_id}")
    assert one.status_code == 200 and one.json()["url"] is None, one.text
    (listed,) = member.get("/api/v1/endpoints").json()["data"]
    assert listed["id"] == endpoint_id and listed["url"] is None
    with member.stream("GET", f"/api/v1/endpoints/{endpoint_id}", params={"watch": "true"}) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data:"))
    assert json.loads(first[5:])["url"] is None
    page = login(server, username, password).get(f"/endpoints/{endpoint_id}")
    assert page.status_code == 200 and endpoint_id in page.text and "10.7.0.3" not in page.text
    assert member.delete(f"/api/v1/endpoints/{endpoint_id}").status_code == 204


def test_live_figures_are_computed_from_the_samples(server, api, artifact):
    """`stats` on GET /endpoints/{id} (and the list with ?stats=true), and the bucketed series the page
    charts, against figures worked out by hand from samples written to the database."""
    now = datetime.now(UTC)
    ago = lambda seconds: now - timedelta(seconds=seconds)  # noqa: E731
    owner = api.get("/api/v1/users/me").json()["id"]
    endpoint_id = stopped_endpoint(server, f"ep-stats-{int(now.timestamp() * 1000) % 10**8}", owner, artifact)
    engine = sa.create_engine(server.env.get("TUNEDECK_DATABASE_URL") or f"sqlite:///{server.data_dir}/tunedeck.db")
    with Session(engine) as s:
        sample = lambda at, source, ttft, duration, tokens, code=200, **kw: EndpointSample(  # noqa: E731
            endpoint_id=endpoint_id, at=at, source=source, ttft_s=ttft, duration_s=duration,
            output_tokens=tokens, status_code=code, **kw,
        )  # fmt: skip
        s.add_all(
            [
                # the last 5 minutes: 4 probes, 2 gateway requests and a gateway error
                sample(ago(10), "probe", 0.1, 1.1, 11, generation_tokens_per_s=40.0),
                sample(ago(20), "probe", 0.4, 0.4, 1, generation_tokens_per_s=60.0),
                sample(ago(30), "probe", 0.3, 2.3, 5),
                sample(ago(40), "probe", 0.2, 1.2, 3),
                sample(ago(50), "gateway", 2.0, 4.0, 21),
                sample(ago(60), "gateway", 1.0, 1.5, 6),
                sample(ago(70), "gateway", None, 0.5, 0, code=502, error="upstream broke off"),
                # only in the last hour
                sample(ago(1800), "probe", 1.0, 1.9, 10),
                # in neither
                sample(ago(7200), "probe", 9.0, 9.0, 1),
            ]
        )
        s.commit()
    engine.dispose()

    stats = api.get(f"/api/v1/endpoints/{endpoint_id}").json()["stats"]
    five, hour = stats["last_5m"], stats["last_1h"]
    # TTFT: probes 0.1 0.2 0.3 0.4 -> p50 halfway between 0.2 and 0.3; p95 at rank 0.95 x 3 = 2.85
    assert five["probe"]["ttft_p50_s"] == pytest.approx(0.25)
    assert five["probe"]["ttft_p95_s"] == pytest.approx(0.3 + 0.85 * 0.1)
    # ITL: (1.1 - 0.1) / 10 = 0.1, (2.3 - 0.3) / 4 = 0.5, (1.2 - 0.2) / 2 = 0.5; one token has none
    assert five["probe"]["itl_p50_s"] == pytest.approx(0.5)
    assert (five["probe"]["requests"], five["probe"]["errors"], five["probe"]["output_tokens"]) == (4, 0, 20)
    assert five["probe"]["output_tokens_per_s"] == pytest.approx(20 / 300)
    assert five["probe"]["server_tokens_per_s"] == pytest.approx(50.0)
    # gateway: TTFT 1.0 and 2.0; ITL 0.1 and 0.1; the error is counted, has no TTFT
    assert five["gateway"]["ttft_p50_s"] == pytest.approx(1.5)
    assert five["gateway"]["ttft_p95_s"] == pytest.approx(1.95)
    assert five["gateway"]["itl_p50_s"] == pytest.approx(0.1)
    assert (five["gateway"]["requests"], five["gateway"]["errors"]) == (3, 1)
    assert five["gateway"]["server_tokens_per_s"] is None
    # all: TTFT 0.1 0.2 0.3 0.4 1.0 2.0 -> p50 at rank 2.5 (0.35), p95 at rank 4.75 (1.0 + 0.75 x 1.0)
    assert five["all"]["ttft_p50_s"] == pytest.approx(0.35)
    assert five["all"]["ttft_p95_s"] == pytest.approx(1.75)
    assert (five["all"]["requests"], five["all"]["errors"], five["all"]["output_tokens"]) == (7, 1, 47)
    # the hour adds the probe at 30 minutes: TTFT 0.1 0.2 0.3 0.4 1.0 -> p50 0.3; ITL 0.1 0.5 0.5 0.1 -> 0.3
    assert hour["probe"]["ttft_p50_s"] == pytest.approx(0.3)
    assert hour["probe"]["itl_p50_s"] == pytest.approx(0.3)
    assert hour["all"]["requests"] == 8 and hour["all"]["output_tokens_per_s"] == pytest.approx(57 / 3600)

    listed = {e["id"]: e for e in api.get("/api/v1/endpoints", params={"stats": "true"}).json()["data"]}
    assert listed[endpoint_id]["stats"] == stats
    assert all(e["stats"] is None for e in api.get("/api/v1/endpoints").json()["data"])

    # The page's charts: 10-minute buckets of the last hour, oldest first; the newest holds the 7 recent
    # samples (as last_5m), the one at 30 minutes is alone in its bucket.
    series = api.get(f"/api/v1/endpoints/{endpoint_id}/stats", params={"minutes": 60, "bucket_s": 600}).json()
    *older, newest = series["points"]
    assert newest["figures"]["all"]["requests"] == 7 and newest["figures"]["probe"] == {
        **five["probe"],
        "output_tokens_per_s": pytest.approx(20 / 600),
    }
    assert [p["figures"]["all"]["requests"] for p in older] == [1]
    assert older[0]["figures"]["probe"]["ttft_p50_s"] == pytest.approx(1.0)
    assert datetime.fromisoformat(older[0]["at"]) < datetime.fromisoformat(newest["at"])
    r = api.get(f"/api/v1/endpoints/{endpoint_id}/stats", params={"minutes": 10080, "bucket_s": 60})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "bucket_s"]
    assert api.delete(f"/api/v1/endpoints/{endpoint_id}").status_code == 204


def test_bad_deploy_requests_are_named(api, artifact):
    before = api.get("/api/v1/endpoints").json()["count"]

    def field_of(r):
        assert r.status_code == 422, r.text
        return r.json()["detail"][0]["loc"][-1]

    assert field_of(api.post("/api/v1/endpoints", json={"artifact_id": "art-nope"})) == "artifact_id"
    r = api.post("/api/v1/endpoints", json={"artifact_id": artifact["id"], "pool": "nope"})
    assert field_of(r) == "pool" and "unknown pool" in r.text
    r = api.post("/api/v1/endpoints", json={"artifact_id": artifact["id"], "max_model_len": 4})
    assert field_of(r) == "max_model_len"
    r = api.post("/api/v1/endpoints", json={"artifact_id": artifact["id"], "data_parallel_size": 2})
    assert field_of(r) == "data_parallel_size" and "built-in model server" in r.text
    body = {"artifact_id": artifact["id"], "pool": "tpu-v6e-8", "data_parallel_size": 3}
    r = api.post("/api/v1/endpoints", json=body)
    assert field_of(r) == "data_parallel_size" and "must divide them (1, 2, 4, 8)" in r.text
    assert api.get("/api/v1/endpoints").json()["count"] == before, "a refused deploy creates nothing"


def test_endpoints_of_a_lost_host_end_on_the_next_beat(server, api, artifact):
    """A host that went silent with endpoints on it: the live worker's beat ends them (a stop that was
    requested completes, the rest fail naming the host), and keeps beating."""
    ids = {status: f"ep-lost-{status}-{os.getpid()}" for status in ("pending", "starting", "ready", "stopping")}
    owner = api.get("/api/v1/users/me").json()["id"]
    for status, endpoint_id in ids.items():
        server.sql(
            "INSERT INTO endpoints (id, owner_id, artifact_id, model, pool, runtime, status, settings, worker,"
            " heartbeat_at, log_tail, attempts, created_at, updated_at) VALUES (:id, :owner, :artifact, :model,"
            " 'cpu', 'local', :status, '{}', 'host-gone', :old, 'last words', 1, :old, :old)",
            id=endpoint_id,
            owner=owner,
            artifact=artifact["id"],
            model=artifact["name"],
            status=status,
            old="2000-01-01 00:00:00" if status != "pending" else "2999-01-01 00:00:00",
        )
    ended = {
        status: wait_endpoint(server, api, endpoint_id, ("stopped", "failed"), timeout=15)
        for status, endpoint_id in ids.items()
        if status != "pending"
    }
    assert ended["stopping"]["status"] == "stopped"
    assert api.get(f"/api/v1/endpoints/{ids['stopping']}/logs").text.strip() == "last words"
    for status in ("starting", "ready"):
        assert ended[status]["status"] == "failed" and "no heartbeat from host-gone" in ended[status]["error"]
    assert api.get(f"/api/v1/endpoints/{ids['pending']}").json()["status"] == "pending"  # still queued
    assert api.delete(f"/api/v1/endpoints/{ids['stopping']}").status_code == 204
    workers = api.get("/api/v1/pools/cpu").json()["workers"]
    assert any(w["online"] for w in workers), "the worker's heartbeat goes on"
    server.sql("DELETE FROM endpoints WHERE id LIKE 'ep-lost-%'")


def postgres_cluster(server) -> tuple[str, str]:
    """The version and name of the local PostgreSQL cluster the server's database is on (by port)."""
    port = sa.make_url(server.env["TUNEDECK_DATABASE_URL"]).port or 5432
    listed = subprocess.run(["pg_lsclusters", "--no-header"], capture_output=True, text=True, check=True).stdout
    (cluster,) = [line.split()[:2] for line in listed.splitlines() if line.split()[2] == str(port)]
    return cluster[0], cluster[1]


@pytest.mark.restarts_postgres
def test_a_database_restart_leaves_a_ready_endpoint_serving(server, api, artifact):
    """PostgreSQL stops for a few seconds and comes back (a restart, a failover) under a ready
    endpoint: its supervisor waits for it, the endpoint stays ready, and the same model server answers."""
    endpoint = deploy(server, api, artifact)
    assert endpoint["status"] == "ready", endpoint["error"]
    proc = model_server(endpoint)
    cluster = ["pg_ctlcluster", "--skip-systemctl-redirect", *postgres_cluster(server)]
    subprocess.run([*cluster, "stop", "-m", "fast"], check=True)
    try:
        time.sleep(6)  # several of the supervisor's beats fail
    finally:
        subprocess.run([*cluster, "start"], check=True)
    gateway = OpenAI(base_url=f"{server.base_url}/v1", api_key=server.admin_token)
    reply = gateway.chat.completions.create(
        model=artifact["name"], messages=[{"role": "user", "content": "still there?"}], max_tokens=4
    )
    assert reply.usage.completion_tokens >= 1
    time.sleep(2)  # the supervisor's beats go on
    after = api.get(f"/api/v1/endpoints/{endpoint['id']}").json()
    assert after["status"] == "ready", after["error"]
    assert proc.is_running() and model_server(after).pid == proc.pid
    assert api.post(f"/api/v1/endpoints/{endpoint['id']}/stop").json()["status"] == "stopping"
    wait_endpoint(server, api, endpoint["id"], ("stopped",), timeout=60)


def test_live_endpoints_are_limited(server, api, artifact):
    """An admin's limit on a user's live endpoints: the deploy (or restart) past it is refused with 429
    naming the limit, and nothing is started; a stopped endpoint frees its place."""
    me = api.get("/api/v1/users/me").json()["id"]
    live = [e for e in api.get("/api/v1/endpoints").json()["data"] if e["status"] not in ("stopped", "failed")]
    limit, before = len(live) + 1, api.get("/api/v1/endpoints").json()["count"]
    assert api.patch(f"/api/v1/users/{me}", json={"max_live_endpoints": limit}).status_code == 200
    # On the tpu-v6e-8 pool, which no worker serves here: they stay pending, live.
    body = {"artifact_id": artifact["id"], "pool": "tpu-v6e-8"}
    made: list[str] = []
    try:
        for _ in range(limit + 1):
            r = api.post("/api/v1/endpoints", json=body)
            if r.status_code != 201:
                break
            made.append(r.json()["id"])
        assert r.status_code == 429, r.text
        said = f"you have {limit} live endpoint{'s' if limit > 1 else ''}; your limit is {limit}"
        assert r.json()["detail"].startswith(said), r.text
        assert made and api.get("/api/v1/endpoints").json()["count"] == before + len(made)  # none for the refused
        assert api.post(f"/api/v1/endpoints/{made[0]}/stop").json()["status"] == "stopped"  # a place is free
        r = api.post("/api/v1/endpoints", json=body)
        assert r.status_code == 201, r.text
        made.append(r.json()["id"])
        r = api.post(f"/api/v1/endpoints/{made[0]}/restart")
        assert r.status_code == 429 and r.json()["detail"].startswith(said), r.text
        assert api.get(f"/api/v1/endpoints/{made[0]}").json()["status"] == "stopped"
    finally:
        api.patch(f"/api/v1/users/{me}", json={"max_live_endpoints": None})
        for endpoint_id in made:
            api.post(f"/api/v1/endpoints/{endpoint_id}/stop")
            assert api.delete(f"/api/v1/endpoints/{endpoint_id}").status_code == 204
