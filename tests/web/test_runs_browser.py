"""The run pages in a real browser (headless Chromium via Playwright) against a real `tunedeck up`
whose Celery worker really trains the tiny model on CPU.

Fixtures (`server`, `page`, ...) come from tests/conftest.py. Screenshots go to test-artifacts/.
"""

import re

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.conftest import ARTIFACTS, wait_dataset

TRAIN_TIMEOUT = 240_000  # ms: the whole tiny run on CPU, compile included
TRAIN_TIMEOUT_S = TRAIN_TIMEOUT / 1000
LIVE_TIMEOUT = 60_000
RUN_PAGE = re.compile(r".*/runs/run-[^/?#]+$")
TERMINAL = ("succeeded", "failed", "cancelled")

# The demo run: long enough for the tiny model to learn the demo task (about 70% of the held-out questions
# answered word for word after 800 steps at this rate, 90% after 1000; none after 300), about a minute on CPU.
TINY = {
    "max_steps": 800,
    "batch_size": 8,
    "max_seq_len": 64,
    "learning_rate": 0.003,
    "eval_every_steps": 200,
    "checkpoint_every_steps": 400,
}
STEPS = [400, 800]  # its checkpoints
SWEEP_SAMPLES = 16  # held-out questions its checkpoint sweep asks

# Shared between tests in this module: the run the acceptance test launched through the form.
_launched: dict[str, str] = {}


@pytest.fixture(scope="module")
def demo_dataset(server) -> dict:
    """The demo dataset, imported through the API and validated."""
    client = server.client()
    r = client.post("/api/v1/datasets/demo")
    assert r.status_code == 201, r.text
    dataset = wait_dataset(server, client, r.json()["id"])
    assert dataset["status"] == "ready", dataset
    return dataset


def second_run(client: httpx.Client, dataset: dict) -> str:
    """A short run beside the launched one, at three times its learning rate (made once, kept for the tests
    after): the compare views' other run."""
    if "second" not in _launched:
        first = client.get(f"/api/v1/runs/{launched_run(client, dataset)}").json()
        config = {**TINY, "max_steps": 60, "eval_every_steps": 20, "checkpoint_every_steps": 60}
        config["learning_rate"] = first["config"]["learning_rate"] * 3
        r = client.post(
            "/api/v1/runs",
            json={"dataset_id": first["dataset_id"], "pool": "cpu", "suffix": first["suffix"], "config": config},
        )
        assert r.status_code == 201, r.text
        _launched["second"] = r.json()["id"]
    return _launched["second"]


def launched_run(client: httpx.Client, dataset: dict) -> str:
    """The run the acceptance test launched from the form; when that test did not run, one made
    through the API (and kept for the tests after)."""
    if "run_id" not in _launched:
        r = client.post("/api/v1/runs", json={"dataset_id": dataset["id"], "pool": "cpu", "config": TINY})
        assert r.status_code == 201, r.text
        _launched["run_id"] = r.json()["id"]
    return _launched["run_id"]


@pytest.fixture
def tiny_run(server, demo_dataset) -> dict:
    """The launched run, finished and succeeded."""
    client = server.client()
    run = wait_run(server, client, launched_run(client, demo_dataset))
    assert run["status"] == "succeeded", describe_failure(server, client, run["id"])
    return run


def run_id_from(url: str) -> str:
    m = re.search(r"/runs/(run-[^/?#]+)$", url)
    assert m, f"not a run page: {url}"
    return m.group(1)


def wait_run(server, client: httpx.Client, run_id: str, timeout: float = TRAIN_TIMEOUT_S) -> dict:
    def done():
        run = client.get(f"/api/v1/runs/{run_id}").json()
        return run if run["status"] in TERMINAL else None

    return server.wait_for(done, timeout=timeout, interval=1, what=f"run {run_id} to finish")


def describe_failure(server, client: httpx.Client, run_id: str) -> str:
    run = client.get(f"/api/v1/runs/{run_id}").json()
    events = client.get(f"/api/v1/runs/{run_id}/events").json()["data"]
    lines = "\n".join(f"  {e['created_at']} {e['level']}: {e['message']}" for e in reversed(events))
    log = server.log()[-3000:]
    return f"run {run_id} is {run['status']}: {run['error']}\nevents:\n{lines}\n--- server log ---\n{log}"


# ---------- tests ----------


def test_launch_tiny_run_and_watch_it_train(page: Page, server):
    """The acceptance test: import the demo data, launch a tiny run from the form and watch it train live."""
    page.goto("/runs/new")
    with page.expect_response(lambda r: r.url.endswith("/api/v1/datasets/demo") and r.request.method == "POST") as info:
        page.get_by_role("button", name="Import demo dataset").click()
    response = info.value
    assert response.status == 201, response.text()
    demo = response.json()
    # The page follows the import's validation and selects the dataset once it is ready.
    expect(page.locator("#dataset_id")).to_have_value(demo["id"], timeout=LIVE_TIMEOUT)
    expect(page.locator("#demo-status")).to_contain_text("Ready")

    page.select_option("#base_model", "tiny-gemma4")
    page.select_option("#pool", "cpu")
    page.fill("[name=max_steps]", str(TINY["max_steps"]))
    page.fill("[name=batch_size]", str(TINY["batch_size"]))
    page.fill("[name=max_seq_len]", str(TINY["max_seq_len"]))
    page.fill("[name=learning_rate]", str(TINY["learning_rate"]))
    expect(page.locator("[name=epochs]")).to_be_disabled()  # max steps wins
    page.locator("#advanced summary").click()
    page.fill("[name=eval_every_steps]", str(TINY["eval_every_steps"]))
    page.fill("[name=checkpoint_every_steps]", str(TINY["checkpoint_every_steps"]))
    page.fill("#suffix", "capitals")

    # The pre-flight panel follows the form: parameters, memory per chip, and a fit on a CPU "chip".
    expect(page.locator("#pf-body")).to_be_visible(timeout=10_000)
    expect(page.locator("#pf-params")).not_to_have_text("–")
    expect(page.locator("#pf-fits")).to_be_visible()
    expect(page.locator("#pf-warning")).to_be_hidden()
    expect(page.locator("#pf-tokens")).to_have_text("410K")  # 800 steps x 8 x 64 tokens
    page.locator("#advanced summary").click()  # close it again for the screenshot
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(ARTIFACTS / "run-new.png"), full_page=True)

    page.get_by_role("button", name="Launch run").click()
    page.wait_for_url(RUN_PAGE, timeout=30_000)
    run_id = run_id_from(page.url)
    _launched["run_id"] = run_id
    page.wait_for_load_state("domcontentloaded")
    page.evaluate("window.__marker = 1")
    client = server.client()

    created = client.get(f"/api/v1/runs/{run_id}").json()
    assert created["dataset_id"] == demo["id"] and created["pool"] == "cpu" and created["base_model"] == "tiny-gemma4"
    assert created["suffix"] == "capitals"
    for key, value in TINY.items():
        assert created["config"][key] == value, (key, created["config"])
    assert created["config"]["epochs"] is None and created["total_steps"] == TINY["max_steps"]

    # Live: the loss chart grows while the run is still running (no reload: the marker survives).
    try:
        page.wait_for_function(
            """() => {
            const chart = window.Chart && Chart.getChart('loss-chart');
            const status = document.getElementById('run-status').textContent.trim();
            return (!!chart && chart.data.datasets[0].data.length >= 2 && status === 'running')
                || ['failed', 'cancelled'].includes(status);
        }""",
            timeout=TRAIN_TIMEOUT,
        )
    except Exception:
        pytest.fail("the loss chart never showed 2 points while running\n" + describe_failure(server, client, run_id))
    status = page.locator("#run-status")
    assert status.inner_text().strip() == "running", describe_failure(server, client, run_id)
    expect(page.locator("#run-phase")).to_be_visible()
    expect(page.locator("#cancel-run")).to_be_visible()
    expect(page.locator("#pause-run")).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "run-training.png"), full_page=True)

    page.wait_for_function(
        "() => ['succeeded', 'failed', 'cancelled'].includes(document.getElementById('run-status').textContent.trim())",
        timeout=TRAIN_TIMEOUT,
    )
    if status.inner_text().strip() != "succeeded":
        expect(page.locator("#run-error")).to_be_visible()  # a failure is shown, with its error
        page.screenshot(path=str(ARTIFACTS / "run-failed.png"), full_page=True)
        pytest.fail(describe_failure(server, client, run_id))
    expect(status).to_have_class(re.compile(r"\bpill-run-succeeded\b"))
    assert page.evaluate("window.__marker") == 1, "the page reloaded"

    # The loss went down: the chart's points, and the same from the API.
    points = page.evaluate("Chart.getChart('loss-chart').data.datasets[0].data.map(p => [p.x, p.y])")
    metric_rows = client.get(f"/api/v1/runs/{run_id}/metrics").json()["data"]
    api_points = [(m["step"], m["loss"]) for m in metric_rows if "loss" in m]
    assert len(points) >= 2 and points[-1][0] == TINY["max_steps"], points
    assert points[-1][1] < points[0][1] * 0.7, f"loss did not fall enough: {points[0]} -> {points[-1]}"
    assert [tuple(p) for p in points] == api_points[-len(points) :]
    # Every eval point is on the chart, including those recorded after a later step's training row.
    api_evals = [[m["step"], m["eval_loss"]] for m in metric_rows if "eval_loss" in m]
    assert len(api_evals) >= 3, api_evals
    charted = "Chart.getChart('loss-chart').data.datasets[1].data.map(p => [p.x, p.y])"
    try:  # the page re-reads what the stream may have missed at most every 2 s; a loaded machine is slower
        page.wait_for_function(
            "(n) => Chart.getChart('loss-chart').data.datasets[1].data.length === n", arg=len(api_evals), timeout=30_000
        )
    except Exception:
        pytest.fail(f"eval points charted {page.evaluate(charted)}, recorded {api_evals}")
    assert page.evaluate(charted) == sorted(api_evals)

    # Checkpoints every 400 steps (both kept), the final model name, the cards, the events log.
    rows = page.locator("#checkpoints-table tbody tr[data-step]")
    expect(rows).to_have_count(2, timeout=10_000)
    assert sorted(int(s) for s in rows.evaluate_all("rs => rs.map(r => r.dataset.step)")) == STEPS
    expect(page.locator("#fine-tuned-model")).to_have_text(re.compile(rf"^ft:tiny-gemma4:capitals:{run_id}$"))
    expect(page.locator("#stat-step")).to_have_text(f"{TINY['max_steps']:,}")
    expect(page.locator("#stat-step-time-note")).to_have_text(re.compile(r"^host memory \d+\.\d\d GB peak$"))
    expect(page.locator("#run-progress-bar")).to_have_class(re.compile(r"\bdone\b"))
    expect(page.locator("#events-table tbody tr").first).to_contain_text("succeeded", timeout=10_000)
    for button in ("#cancel-run", "#pause-run", "#resume-run"):
        expect(page.locator(button)).to_be_hidden()
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(ARTIFACTS / "run-succeeded.png"), full_page=True)

    # The list shows it, finished.
    page.goto("/runs")
    row = page.locator(f'#runs-body tr[data-id="{run_id}"]')
    expect(row.locator(".pill")).to_have_text("succeeded")
    expect(row).to_contain_text(f"{TINY['max_steps']:,} / {TINY['max_steps']:,}")


def test_compare_view(page: Page, server, demo_dataset):
    client = server.client()
    first, second = launched_run(client, demo_dataset), second_run(client, demo_dataset)
    for run_id in (first, second):
        run = wait_run(server, client, run_id)
        assert run["status"] == "succeeded", describe_failure(server, client, run_id)

    # Pick both on the list and press Compare.
    page.goto("/runs")
    compare = page.locator("#compare-btn")
    expect(compare).to_be_disabled()
    page.locator(f'#runs-body tr[data-id="{first}"] input.run-select').check()
    expect(compare).to_be_disabled()
    page.locator(f'#runs-body tr[data-id="{second}"] input.run-select').check()
    expect(compare).to_be_enabled()
    page.screenshot(path=str(ARTIFACTS / "runs-list.png"), full_page=True)
    compare.click()
    page.wait_for_url(re.compile(r".*/runs/compare\?ids=.+"))
    assert set(page.url.split("ids=")[1].split(",")) == {first, second}

    # One loss curve per run, labelled with the run and its pool.
    page.wait_for_function(
        """() => {
        const chart = window.Chart && Chart.getChart('compare-chart');
        return !!chart && chart.data.datasets.length === 2 && chart.data.datasets.every(d => d.data.length >= 2);
    }""",
        timeout=LIVE_TIMEOUT,
    )
    labels = page.evaluate("Chart.getChart('compare-chart').data.datasets.map(d => d.label)")
    assert sorted(labels) == sorted([f"{first} · cpu", f"{second} · cpu"]), labels

    # The config table shows what differs (the learning rate), and everything on request.
    lr_row = page.locator('#diff-table tr[data-key="learning_rate"]')
    expect(lr_row).to_be_visible()
    expect(lr_row).to_have_class(re.compile(r"\bdiff\b"))
    expect(page.locator('#diff-table tr[data-key="lora_rank"]')).to_have_count(0)
    page.locator("#show-all-keys").check()
    rank_row = page.locator('#diff-table tr[data-key="lora_rank"]')
    expect(rank_row).to_be_visible()
    expect(rank_row).not_to_have_class(re.compile(r"\bdiff\b"))
    expect(lr_row).to_have_class(re.compile(r"\bdiff\b"))
    page.locator("#show-all-keys").uncheck()
    expect(page.locator('#summary-table tr[data-key="Cost"] td')).to_have_count(2)

    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(ARTIFACTS / "runs-compare.png"), full_page=True)


def test_bad_config_errors_shown_inline(page: Page, server, demo_dataset):
    client = server.client()
    before = client.get("/api/v1/runs").json()["count"]
    page.goto(f"/runs/new?dataset={demo_dataset['id']}")
    expect(page.locator("#dataset_id")).to_have_value(demo_dataset["id"])

    # A value the schema rejects: the message sits under that field, and nothing is launched.
    page.fill("[name=lora_rank]", "0")
    page.get_by_role("button", name="Launch run").click()
    rank = page.locator('[data-field="config.lora_rank"]')
    expect(rank.locator(".field-error")).to_contain_text("greater than or equal to 1")
    expect(rank).to_have_class(re.compile(r"\bhas-error\b"))
    assert page.url.endswith(f"/runs/new?dataset={demo_dataset['id']}"), page.url

    # A mesh the model cannot use (the server's own check): the Advanced section opens to show it.
    page.fill("[name=lora_rank]", "8")
    expect(page.locator("#advanced")).not_to_have_attribute("open", "")
    page.locator("#advanced summary").click()
    page.fill("[name=mesh_tp]", "4")
    page.locator("#advanced summary").click()  # closed again: the error must open it
    page.get_by_role("button", name="Launch run").click()
    tp = page.locator('[data-field="config.mesh_tp"]')
    expect(tp.locator(".field-error")).to_contain_text("must divide")
    expect(tp).to_be_in_viewport()
    expect(page.locator("#advanced")).to_have_attribute("open", "")
    expect(rank.locator(".field-error")).to_have_count(0)
    # The pre-flight panel says why it has no estimate.
    expect(page.locator("#pf-error")).to_be_visible()
    assert "/runs/new" in page.url
    page.screenshot(path=str(ARTIFACTS / "run-new-errors.png"), full_page=True)
    assert client.get("/api/v1/runs").json()["count"] == before, "a bad config was launched"


def test_a_run_is_cancelled_then_deleted_from_its_page(page: Page, server, demo_dataset):
    client = server.client()
    # On the TPU pool, which no test worker serves: it waits there, queued.
    r = client.post("/api/v1/runs", json={"dataset_id": demo_dataset["id"], "pool": "tpu-v5p-8"})
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    page.on("dialog", lambda dialog: dialog.accept())
    page.goto(f"/runs/{run_id}")
    expect(page.locator("#run-status")).to_have_text("queued")
    expect(page.locator("#delete-run")).to_be_hidden()  # an active run is cancelled first
    page.locator("#cancel-run").click()
    expect(page.locator("#run-status")).to_have_text("cancelled")
    page.locator("#delete-run").click()
    page.wait_for_url(f"{server.base_url}/runs")
    expect(page.locator(f'#runs-body tr[data-id="{run_id}"]')).to_have_count(0)
    assert client.get(f"/api/v1/runs/{run_id}").status_code == 404


def test_artifacts_merged_on_success_and_exported_on_demand(page: Page, server, tiny_run):
    client = server.client()
    run, run_id = tiny_run, tiny_run["id"]
    page.goto(f"/runs/{run_id}")

    # The merged model of the final checkpoint, verified against the LoRA model.
    merged = page.locator('#artifacts-table tbody tr[data-kind="merged"]')
    expect(merged).to_have_count(1, timeout=10_000)
    expect(merged).to_have_attribute("data-status", "succeeded", timeout=TRAIN_TIMEOUT)
    expect(merged.locator(".tag-green")).to_contain_text("passed")
    expect(merged).to_contain_text(run["fine_tuned_model"])
    merged.locator("summary").click()
    link = merged.locator("a", has_text="model.safetensors")
    expect(link).to_have_attribute("href", re.compile(r"^/api/v1/artifacts/art-[0-9a-f]+/files/model.safetensors$"))

    # Export the first checkpoint as a PEFT adapter from its row; the new artifact goes live on the page.
    page.locator(f'#checkpoints-table tr[data-step="{STEPS[0]}"] button[data-kind="adapter"]').click()
    adapter = page.locator('#artifacts-table tbody tr[data-kind="adapter"]')
    expect(adapter).to_have_count(1, timeout=10_000)
    expect(adapter).to_have_attribute("data-status", "succeeded", timeout=TRAIN_TIMEOUT)
    expect(adapter.locator("td").nth(2)).to_have_text(str(STEPS[0]))
    adapter.locator("summary").click()
    expect(adapter.locator("a", has_text="adapter_model.safetensors")).to_be_visible()
    page.locator("#artifacts-card").screenshot(path=str(ARTIFACTS / "run-artifacts.png"))

    # The merged model's own page: finished, verified, its files downloadable.
    merged.locator("td").first.locator("a").click()
    expect(page).to_have_url(re.compile(r".*/artifacts/art-[0-9a-f]+$"))
    expect(page.locator("#artifact-status")).to_have_text("succeeded")
    expect(page.locator("#verification")).to_contain_text("passed")
    expect(page.locator("#files-table a", has_text="model.safetensors")).to_be_visible()
    expect(page.locator("#progress-percent")).to_have_text("100%")
    page.screenshot(path=str(ARTIFACTS / "artifact-page.png"), full_page=True)
    listed = client.get("/api/v1/artifacts", params={"run_id": run_id}).json()["data"]
    page.goto("/artifacts")  # the list of all artifacts (this run's among them)
    for a in listed:
        row = page.locator(f'#artifacts-table tbody tr[data-id="{a["id"]}"]')
        expect(row).to_have_attribute("data-status", "succeeded", timeout=10_000)
    assert sorted((a["kind"], a["checkpoint_step"], a["status"]) for a in listed) == [
        ("adapter", STEPS[0], "succeeded"),
        ("merged", STEPS[1], "succeeded"),
    ]

    # The run's Delete button says what is in the way: its artifacts, named.
    page.on("dialog", lambda dialog: dialog.accept())
    page.goto(f"/runs/{run_id}")
    page.locator("#delete-run").click()
    expect(page.locator("#action-error")).to_contain_text("delete them first")
    for a in listed:
        expect(page.locator("#action-error")).to_contain_text(a["id"])
    assert client.get(f"/api/v1/runs/{run_id}").status_code == 200


def test_deploy_a_merged_model_chat_in_the_playground_and_watch_its_charts(page: Page, server, tiny_run):
    client = server.client()
    run_id = tiny_run["id"]

    def merged():
        arts = client.get("/api/v1/artifacts", params={"run_id": run_id}).json()["data"]
        art = next((a for a in arts if a["kind"] == "merged"), None)
        return art if art and art["status"] in ("succeeded", "failed") else None

    art = server.wait_for(merged, timeout=TRAIN_TIMEOUT_S, what="the merged artifact")
    assert art["status"] == "succeeded", art["error"]

    # Deploy from the artifact's page, on the cpu pool: the endpoint's page follows it to ready.
    page.goto(f"/artifacts/{art['id']}")
    expect(page.locator("#deploy-actions")).to_be_visible(timeout=10_000)
    # a vLLM pool offers data-parallel replicas beside tensor parallelism; the built-in server has one
    page.select_option("#deploy-pool", "tpu-v6e-8")
    expect(page.locator("#deploy-dp option")).to_have_text(
        ["1 (TP 8)", "2 (TP 4 each)", "4 (TP 2 each)", "8 (TP 1 each)"]
    )
    page.select_option("#deploy-pool", "cpu")
    expect(page.locator("#deploy-dp-wrap")).to_be_hidden()
    page.click("#deploy-button")
    expect(page).to_have_url(re.compile(r".*/endpoints/ep-[0-9a-f]+$"))
    expect(page.locator("#endpoint-status")).to_have_text("ready", timeout=TRAIN_TIMEOUT)
    expect(page.locator("#gateway-url")).to_have_text(f"{server.base_url}/v1")

    # The playground streams a reply through the gateway, with its TTFT and tokens/s.
    page.fill("#chat-input", "Hello there!")
    page.click("#chat-send")
    expect(page.locator(".chat-stats")).to_contain_text("TTFT", timeout=60_000)
    expect(page.locator(".chat-stats")).to_contain_text("tokens")
    expect(page.locator(".chat-assistant .chat-answer")).not_to_have_text("")

    # The charts fill with the probes' and the playground's requests.
    for chart in ("ttft-chart", "tps-chart"):
        page.wait_for_function(
            "id => window.Chart && Chart.getChart(document.getElementById(id)).data.datasets[0].data.length > 0",
            arg=chart,
            timeout=30_000,
        )
    expect(page.locator("#ttft-empty")).to_be_hidden()
    expect(page.locator("#ttft-summary")).to_contain_text("p50")
    expect(page.locator("#tps-summary")).to_contain_text("tokens/s")
    endpoint_id = page.url.rsplit("/", 1)[-1]

    def summary_is_the_apis():  # the page shows the API's figures (it refreshes every 3 s; probes add requests)
        hour = client.get(f"/api/v1/endpoints/{endpoint_id}").json()["stats"]["last_1h"]["all"]
        shown = page.locator("#ttft-summary").text_content() or ""
        return f"p50 {1000 * hour['ttft_p50_s']:.0f} ms" in shown and f"{hour['requests']} requests" in shown

    server.wait_for(summary_is_the_apis, timeout=30, interval=0.5, what="the page's TTFT summary to be the API's")
    expect(page.locator("#endpoint-log")).to_contain_text("tunedeck-phase: compiling")  # the server's output
    expect(page.locator("#restart-button")).to_be_disabled()

    # Benchmark: a small concurrency sweep; its levels fill the table and the latency/throughput curve.
    page.fill("#bench-levels", "1, 2")
    page.fill("#bench-prompts", "4")
    page.fill("#bench-input", "16")
    page.fill("#bench-output", "8")
    page.fill("#bench-slo-ttft", "600000")  # every request is within it: its goodput is its throughput
    page.click("#bench-run")
    expect(page.locator("#bench-table tbody tr")).to_have_count(2, timeout=120_000)
    expect(page.locator("#bench-table tbody tr").first).to_contain_text("c=1")
    expect(page.locator("#bench-status")).to_have_text("succeeded", timeout=30_000)
    expect(page.locator("#bench-table thead")).to_contain_text("goodput req/s")
    expect(page.locator("#bench-table thead")).to_contain_text("TTFT p50 / p99 ms")
    cells = page.locator("#bench-table tbody tr").first.locator("td")
    expect(cells.nth(3)).to_have_text(cells.nth(2).text_content() or "")
    page.wait_for_function(
        "() => Chart.getChart(document.getElementById('bench-chart')).data.datasets[0].data.length === 2"
    )
    page.screenshot(path=str(ARTIFACTS / "endpoint-page.png"), full_page=True)
    endpoint_url = page.url
    page.goto("/benchmarks")  # the compare page draws it, ticked
    expect(page.locator("#benchmarks-table tbody tr input").first).to_be_checked()  # the newest: this one
    expect(page.locator("#compare-tables table").first.locator("tbody tr")).to_have_count(2)
    page.wait_for_function("() => Chart.getChart(document.getElementById('compare-chart')).data.datasets.length >= 2")
    page.screenshot(path=str(ARTIFACTS / "benchmarks-page.png"), full_page=True)
    page.goto(endpoint_url)
    expect(page.locator("#endpoint-status")).to_have_text("ready")

    # A long benchmark: Cancel stops it, and its badge says so.
    page.fill("#bench-levels", "2")
    page.fill("#bench-prompts", "500")
    page.fill("#bench-output", "100")
    page.click("#bench-run")
    expect(page.locator("#bench-status")).to_have_text("running", timeout=30_000)
    page.click("#bench-cancel")
    expect(page.locator("#bench-status")).to_have_text("cancelled", timeout=15_000)
    expect(page.locator("#bench-status")).to_have_class(re.compile(r"\bpill-run-cancelled\b"))
    expect(page.locator("#bench-cancel")).to_be_hidden()

    # Stop: the endpoint stops; Restart starts it again (stopped again at once), and the list shows it so.
    page.click("#stop-button")
    expect(page.locator("#endpoint-status")).to_have_text("stopped", timeout=60_000)
    page.click("#restart-button")
    expect(page.locator("#endpoint-status")).to_have_text(re.compile("pending|starting|ready"), timeout=10_000)
    expect(page.locator("#endpoint-error")).to_be_hidden()
    page.click("#stop-button")
    expect(page.locator("#endpoint-status")).to_have_text("stopped", timeout=60_000)
    endpoint_id = page.url.rsplit("/", 1)[1]
    page.goto("/endpoints")
    expect(page.locator("#endpoints-table tbody")).to_contain_text(endpoint_id)
    expect(page.locator("#endpoints-table tbody tr", has_text=endpoint_id)).to_contain_text("stopped")


# The whole acceptance flow (a sweep of three subjects served in turn, two promotions, an arena vote) in one
# test: beside the rest of the suite on a 2-core machine it has taken over the 300 s every test gets.
@pytest.mark.timeout(900)
def test_an_evaluation_page_shows_progress_scores_and_samples(page: Page, server, tiny_run):
    """From the run page, "Evaluate all checkpoints": every checkpoint of the run and its base, asked the
    run's eval set. The evaluation's page follows it live to its scores (a table with intervals, a chart)
    and its samples, reordered by where the subjects differ; back on the run page, the score against the
    step, the base as a line, and the best checkpoint marked."""
    client = server.client()
    page.goto(f"/runs/{tiny_run['id']}")
    expect(page.locator("#sweep-empty")).to_be_visible()
    page.fill("#sweep-samples", str(SWEEP_SAMPLES))
    page.fill("#sweep-tokens", "12")
    page.click("#sweep-start")
    expect(page).to_have_url(re.compile(r".*/evaluations/ev-[^/?#]+$"))
    evaluation = {"id": page.url.rsplit("/", 1)[1]}
    created = client.get(f"/api/v1/evaluations/{evaluation['id']}").json()
    assert [s.get("step") for s in created["subjects"]] == [*STEPS, None], created["subjects"]
    assert created["dataset_id"] == tiny_run["dataset_id"] and created["config"]["metrics"] == ["exact_match", "chrf"]
    assert created["config"]["validation_of"] == tiny_run["id"]  # the records its training held out
    page.goto("/evaluations")
    expect(page.locator("#evaluations-table tbody tr").first).to_contain_text(evaluation["id"])
    page.locator("#evaluations-table a", has_text=evaluation["id"]).click()
    expect(page).to_have_url(re.compile(rf".*/evaluations/{evaluation['id']}$"))
    expect(page.locator("#live")).to_have_text("Live", timeout=LIVE_TIMEOUT)
    expect(page.locator("#eval-set")).to_contain_text(f"the validation split of run {tiny_run['id']}")
    # Three subjects served one after another (one of them merged first) beside the rest of the suite:
    # on a loaded 2-core machine that has taken longer than a run trains.
    expect(page.locator("#evaluation-status")).to_have_text("succeeded", timeout=2 * TRAIN_TIMEOUT)
    expect(page.locator("#progress-count")).to_have_text(f"{3 * SWEEP_SAMPLES} of {3 * SWEEP_SAMPLES} replies")

    scores = client.get(f"/api/v1/evaluations/{evaluation['id']}").json()["summary"]
    rows = page.locator("#summary-table tbody tr")
    expect(rows).to_have_count(3)
    chrf = scores["s1"]["chrf"]
    expect(rows.nth(1)).to_contain_text(f"{100 * chrf['mean']:.1f} [{100 * chrf['low']:.1f}–{100 * chrf['high']:.1f}]")
    expect(rows.nth(2)).to_contain_text("tiny-gemma4 (base)")
    assert page.locator("#summary-chart").bounding_box()["height"] > 100
    # The demo task is learnt: the final checkpoint answers held-out questions word for word, the base
    # model (random weights) none, and their intervals do not overlap.
    final, base = scores["s1"]["exact_match"], scores["s2"]["exact_match"]
    assert final["mean"] >= 0.3 and final["low"] > base["high"], (final, base)

    samples = page.locator("#samples-table tbody tr")
    expect(samples).to_have_count(SWEEP_SAMPLES)
    expect(samples.first.locator("td").first).to_have_text("0")
    page.select_option("#samples-order", "spread")
    spread = client.get(f"/api/v1/evaluations/{evaluation['id']}/samples", params={"order": "spread"}).json()["data"]
    expect(samples.first.locator("td").first).to_have_text(str(spread[0]["position"]))
    expect(page.locator("#download-samples")).to_have_attribute(
        "href", f"/api/v1/evaluations/{evaluation['id']}/samples.jsonl"
    )
    page.screenshot(path=str(ARTIFACTS / "evaluation.png"), full_page=True)

    # The run page charts the sweep: exact match by step, the base model's as a line, the best step marked.
    page.goto(f"/runs/{tiny_run['id']}")
    page.select_option("#sweep-metric", "exact_match")
    by_step = {STEPS[0]: scores["s0"]["exact_match"]["mean"], STEPS[1]: final["mean"]}
    best = max(by_step, key=lambda step: by_step[step])
    assert best == STEPS[1], by_step  # still learning: no overfitting yet
    expect(page.locator("#sweep-best")).to_have_text(f"Best by exact_match: step {best} ({100 * by_step[best]:.1f}%)")
    expect(page.locator("#sweep-note")).to_contain_text(f"base model {100 * base['mean']:.1f}%")
    assert page.locator("#sweep-chart").bounding_box()["height"] > 100
    expect(page.locator("#sweep-link")).to_have_text(f"{evaluation['id']} · succeeded")
    page.locator("#sweep-card").screenshot(path=str(ARTIFACTS / "checkpoint-sweep.png"))

    # Promote the best checkpoint from the evaluation page (a new endpoint), then the other one too: two
    # models for the arena, which streams both answers side by side and names them once voted on.
    page.goto(f"/evaluations/{evaluation['id']}")
    expect(page.locator("#promote-card")).to_be_visible(timeout=LIVE_TIMEOUT)
    options = page.locator("#promote-subject option")
    expect(options).to_have_count(2)
    expect(options.first).to_contain_text(re.compile(rf"step {STEPS[1]} · \w+ [\d.]+ \(best\)$"))  # the final one
    expect(page.locator("#promote-target")).to_have_value("")  # a new endpoint
    deployed = []
    for option in (0, 1):
        page.select_option("#promote-subject", index=option)
        page.click("#promote-button")
        link = page.locator("#promoted-endpoint")
        expect(link).not_to_have_text(deployed[-1] if deployed else "", timeout=LIVE_TIMEOUT)
        expect(link).to_have_text(re.compile(r"ep-\w+"))
        deployed.append(link.text_content())
    page.locator("#promote-card").screenshot(path=str(ARTIFACTS / "promote.png"))
    for endpoint_id in deployed:
        server.wait_for(
            lambda e=endpoint_id: client.get(f"/api/v1/endpoints/{e}").json()["status"] == "ready",
            timeout=TRAIN_TIMEOUT / 1000,
            what=f"endpoint {endpoint_id} ready",
        )
    page.goto("/arena")
    page.select_option("#arena-left", deployed[0])
    page.select_option("#arena-right", deployed[1])
    page.fill("#arena-prompt", "What is the capital of France?")
    page.fill("#arena-tokens", "12")
    page.click("#arena-ask")
    for side in ("a", "b"):
        expect(page.locator(f"#arena-answer-{side}")).to_have_attribute("data-done", "true", timeout=LIVE_TIMEOUT)
        expect(page.locator(f"#arena-name-{side}")).to_have_text("")  # hidden until the vote
    battle = client.get("/api/v1/arena/battles").json()["data"][0]  # the newest
    for side in ("a", "b"):
        expect(page.locator(f"#arena-answer-{side}")).to_have_text(battle["outputs"][side])
    page.click("[data-vote=a]")
    expect(page.locator("#arena-voted")).to_have_text("Voted: A is better")
    battle = client.get(f"/api/v1/arena/battles/{battle['id']}").json()
    assert battle["vote"] == "a" and {s["endpoint_id"] for s in battle["sides"]} == set(deployed)
    expect(page.locator("#arena-name-a")).to_contain_text(battle["sides"][0]["endpoint_id"])
    for s in battle["sides"]:  # the standings have a row for each
        expect(page.locator(f'#arena-standings tbody tr[data-model="{s["model"]}"]')).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "arena.png"), full_page=True)
    for endpoint_id in deployed:
        client.post(f"/api/v1/endpoints/{endpoint_id}/stop")

    # The compare view of the two runs: the other run's final checkpoint asked the same held-out questions
    # (its own split is the same records: one dataset, fraction and seed) lines up with this sweep, with
    # the settings that differ beside the scores and costs.
    other = wait_run(server, client, second_run(client, {"id": tiny_run["dataset_id"]}))
    assert other["status"] == "succeeded", describe_failure(server, client, other["id"])
    r = client.post(
        "/api/v1/evaluations",
        json={
            "validation_of": other["id"],
            "subjects": [{"kind": "checkpoint", "run_id": other["id"]}],
            "metrics": ["exact_match", "chrf"],
            "max_samples": SWEEP_SAMPLES,
            "max_tokens": 12,
        },
    )
    assert r.status_code == 201, r.text

    def evaluated():
        e = client.get(f"/api/v1/evaluations/{r.json()['id']}").json()
        return e if e["status"] in TERMINAL else None

    done = server.wait_for(evaluated, timeout=TRAIN_TIMEOUT_S, interval=1, what="the other run's evaluation")
    assert done["status"] == "succeeded", done["error"]
    compared = client.get("/api/v1/evaluations/compare", params={"run_ids": f"{tiny_run['id']},{other['id']}"}).json()
    (same,) = compared["data"]  # one eval set: both evaluations asked the same records
    assert [(row["run_id"], row["step"]) for row in same["rows"]] == [
        *((tiny_run["id"], step) for step in STEPS),
        (other["id"], other["total_steps"]),
        (None, None),  # the base
    ]
    assert same["config_differences"]["learning_rate"] == {
        tiny_run["id"]: TINY["learning_rate"],
        other["id"]: other["config"]["learning_rate"],
    }
    assert "lora_rank" not in same["config_differences"]

    page.goto(f"/runs/compare?ids={tiny_run['id']},{other['id']}")
    table = page.locator(f'#evals-card .eval-set[data-eval-set="{same["eval_set"]}"] table')
    expect(table.locator("tbody tr")).to_have_count(4, timeout=LIVE_TIMEOUT)
    best = table.locator(f'tbody tr[data-run="{tiny_run["id"]}"][data-step="{STEPS[1]}"] td[data-metric="exact_match"]')
    expect(best).to_have_class(re.compile(r"\bbest\b"))
    expect(best).to_contain_text(f"{100 * final['mean']:.1f} [")
    lr = table.locator(f'tbody tr[data-run="{other["id"]}"] td[data-key="learning_rate"]')
    expect(lr).to_have_text(str(other["config"]["learning_rate"]))
    expect(table.locator("thead")).to_contain_text("Evaluation cost")
    page.locator("#evals-card").screenshot(path=str(ARTIFACTS / "evaluations-compare.png"))
