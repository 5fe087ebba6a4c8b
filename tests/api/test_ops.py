"""Health, metrics and the OpenAPI document."""

from prometheus_client.parser import text_string_to_metric_families


def test_healthz_needs_no_auth(server):
    assert server.anonymous().get("/healthz").json() == {"status": "ok"}


def test_metrics_report_requests_queues_and_workers(server, api):
    api.get("/api/v1/pools")
    text = server.anonymous().get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = families["tunedeck_http_requests"].samples
    assert any(s.labels.get("route") == "/api/v1/pools" and s.labels["status"] == "200" for s in requests)
    assert "tunedeck_http_request_duration_seconds" in families
    workers = {s.labels["pool"]: s.value for s in families["tunedeck_workers_online"].samples}
    assert workers["cpu"] >= 1 and workers["tpu-v5p-8"] == 0
    depths = {s.labels["queue"] for s in families["tunedeck_queue_depth"].samples}
    assert {"general", "cpu"} <= depths


def test_openapi_docs_served(server):
    assert server.anonymous().get("/docs").status_code == 200
    schema = server.anonymous().get("/openapi.json").json()
    assert schema["info"]["title"] == "Tunedeck"
