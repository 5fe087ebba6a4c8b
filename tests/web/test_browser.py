"""The dashboard in a real browser (headless Chromium via Playwright) against a real `tunedeck up`.

Fixtures (`server`, `page`, ...) come from tests/conftest.py. Screenshots go to test-artifacts/.
"""

import json
import re
import uuid

import httpx
from playwright.sync_api import Page, expect

from tests.conftest import ARTIFACTS, make_user, upload, wait_dataset
from tests.web.conftest import watch_page_errors

LIVE_TIMEOUT = 60_000  # ms: validation runs in the worker; the page follows it over SSE


# ---------- data ----------

TOPICS = [
    "rotate an API key",
    "resize a volume",
    "read the billing report",
    "invite a teammate",
    "restore a backup",
    "enable two-factor login",
    "move a project",
    "export audit logs",
    "raise a quota",
    "pin a model version",
]


def chat_record(i: int, *, system_last: bool = False) -> dict:
    topic = TOPICS[i % len(TOPICS)]
    question = f"Record {i}: how do I {topic}? " + "Please be specific about the steps. " * (i % 4)
    answer = f"To {topic}, open Settings, pick the project, and follow step {i}. " + "Then confirm the change. " * (
        i % 7 + 1
    )
    system = {
        "role": "system",
        "content": "You are a concise support agent for Acme Cloud." + " Stay polite." * (i % 3),
    }
    user = {"role": "user", "content": question}
    assistant = {"role": "assistant", "content": answer}
    messages = [user, system, assistant] if system_last else [system, user, assistant]
    return {"messages": messages}


def chat_jsonl(n: int = 20) -> bytes:
    return "".join(json.dumps(chat_record(i)) + "\n" for i in range(1, n + 1)).encode()


def broken_chat_jsonl() -> bytes:
    """20 lines: 7 is not JSON, 12 has no `messages`, 15 has a system turn after a user turn."""
    lines = []
    for i in range(1, 21):
        if i == 7:
            lines.append('{"messages": [{"role": "user", "content": "unterminated"')
        elif i == 12:
            lines.append(json.dumps({"prompt": "x"}))
        elif i == 15:
            lines.append(json.dumps(chat_record(i, system_last=True)))
        else:
            lines.append(json.dumps(chat_record(i)))
    return ("\n".join(lines) + "\n").encode()


def prompt_completion_jsonl(n: int = 12) -> bytes:
    rows = [
        {
            "prompt": f"Translate to French ({i}): good morning number {i}",
            "completion": f"bonjour numéro {i}" + " !" * (i % 3),
        }
        for i in range(1, n + 1)
    ]
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def dataset_id_from(url: str) -> str:
    m = re.search(r"/datasets/([^/?#]+)$", url)
    assert m, f"not a dataset page: {url}"
    return m.group(1)


DATASET_PAGE = re.compile(r".*/datasets/[^/?#]+$")


# ---------- tests ----------


def test_drag_and_drop_upload_reaches_ready_live(page: Page, server):
    page.goto("/datasets")
    expect(page.locator("#dropzone")).to_be_visible()

    # Record what the progress bar does: the page navigates away as soon as the upload is done.
    progress: list[dict] = []
    page.expose_function("__reportUploadProgress", lambda state: progress.append(state))
    page.evaluate("""() => {
        const status = document.getElementById('upload-status');
        const bar = document.getElementById('upload-progress');
        const report = () => window.__reportUploadProgress({
            visible: !status.hidden, value: Number(bar.getAttribute('aria-valuenow')),
            bytes: document.getElementById('upload-bytes').textContent,
        });
        new MutationObserver(report).observe(document.getElementById('upload-card'),
            {attributes: true, subtree: true, childList: true, characterData: true});
    }""")

    content = chat_jsonl(20).decode()
    dt = page.evaluate_handle(
        """(content) => {
        const dt = new DataTransfer();
        dt.items.add(new File([content], 'support-chats.jsonl', {type: 'application/x-ndjson'}));
        return dt;
    }""",
        content,
    )
    page.dispatch_event("#dropzone", "dragenter", {"dataTransfer": dt})
    page.dispatch_event("#dropzone", "dragover", {"dataTransfer": dt})
    expect(page.locator("#dropzone")).to_have_class(re.compile(r"\bover\b"))
    page.dispatch_event("#dropzone", "drop", {"dataTransfer": dt})

    page.wait_for_url(DATASET_PAGE, timeout=30_000)
    dataset_id = dataset_id_from(page.url)
    page.wait_for_load_state("domcontentloaded")
    page.evaluate("window.__marker = 1")

    assert any(p["visible"] for p in progress), f"the progress bar never showed: {progress}"
    assert max(p["value"] for p in progress) == 100, f"the progress bar never completed: {progress}"
    assert any("MB" in p["bytes"] for p in progress)

    # Everything below arrives over the SSE stream: the page is never reloaded.
    status = page.locator("#dataset-status")
    expect(status).to_have_text("ready", timeout=LIVE_TIMEOUT)
    expect(status).to_have_class(re.compile(r"\bpill-ready\b"))
    expect(page.locator("#stat-rows")).to_have_text("20", timeout=LIVE_TIMEOUT)
    expect(page.locator("#stat-valid")).to_have_text("20")
    expect(page.locator("#stat-errors")).to_have_text("0")
    expect(page.locator("#validation-progress")).to_be_hidden()
    page.wait_for_function(
        """() => {
        const chart = window.Chart && Chart.getChart('length-histogram');
        return !!chart && chart.data.datasets[0].data.reduce((a, b) => a + b, 0) === 20;
    }""",
        timeout=LIVE_TIMEOUT,
    )
    bars = page.evaluate("Chart.getChart('length-histogram').data.datasets[0].data")
    assert sum(bars) == 20 and len(bars) >= 1
    # The preview shows conversations, escaped, as bubbles per role.
    expect(page.locator("#preview .turn.system").first).to_be_visible()
    expect(page.locator("#preview .turn.user .bubble").first).to_contain_text("Record 1: how do I")
    assert page.evaluate("window.__marker") == 1, "the page reloaded"

    api = server.client().get(f"/api/v1/datasets/{dataset_id}").json()
    assert api["status"] == "ready" and api["rows"] == 20 and api["filename"] == "support-chats.jsonl"

    page.screenshot(path=str(ARTIFACTS / "dataset-ready.png"), full_page=True)


def test_invalid_dataset_lines_shown(page: Page, server):
    client = server.client()
    r = upload(client, "broken-chats.jsonl", broken_chat_jsonl())
    assert r.status_code == 201, r.text
    dataset = wait_dataset(server, client, r.json()["id"])
    assert dataset["status"] == "invalid", dataset
    assert [e["line"] for e in dataset["errors"]] == [7, 12, 15], dataset["errors"]

    page.goto(f"/datasets/{dataset['id']}")
    status = page.locator("#dataset-status")
    expect(status).to_have_text("invalid")
    expect(status).to_have_class(re.compile(r"\bpill-invalid\b"))
    rows = page.locator("#errors-table tbody tr[data-line]")
    expect(rows).to_have_count(3)
    assert rows.evaluate_all("rs => rs.map(r => r.dataset.line)") == ["7", "12", "15"]
    for i, error in enumerate(dataset["errors"]):
        expect(rows.nth(i)).to_contain_text(error["message"])
    expect(page.locator("#stat-errors")).to_have_text(str(dataset["error_count"]))
    page.screenshot(path=str(ARTIFACTS / "dataset-invalid.png"), full_page=True)


def test_file_picker_upload_and_live_list(page: Page, server):
    page.goto("/datasets")
    expect(page.locator("#live")).to_have_text("Live", timeout=10_000)
    page.set_input_files(
        "#file-input",
        files=[
            {
                "name": "translations.jsonl",
                "mimeType": "application/x-ndjson",
                "buffer": prompt_completion_jsonl(),
            }
        ],
    )
    page.wait_for_url(DATASET_PAGE, timeout=30_000)
    dataset_id = dataset_id_from(page.url)
    expect(page.locator("#dataset-status")).to_have_text("ready", timeout=LIVE_TIMEOUT)
    expect(page.locator("#stat-rows")).to_have_text("12", timeout=LIVE_TIMEOUT)
    expect(page.locator("#dataset-meta")).to_contain_text("prompt_completion")

    # The list follows new uploads without a reload.
    page.goto("/datasets")
    expect(page.locator(f'#datasets-body tr[data-id="{dataset_id}"] .pill')).to_have_text("ready")
    expect(page.locator("#live")).to_have_text("Live", timeout=10_000)
    page.evaluate("window.__marker = 1")
    r = upload(server.client(), "live-list.jsonl", chat_jsonl(5))
    assert r.status_code == 201, r.text
    new_row = page.locator(f'#datasets-body tr[data-id="{r.json()["id"]}"]')
    expect(new_row).to_contain_text("live-list.jsonl", timeout=LIVE_TIMEOUT)
    expect(new_row.locator(".pill")).to_have_text("ready", timeout=LIVE_TIMEOUT)
    expect(page.locator("#datasets-body tr").first).to_have_attribute("data-id", r.json()["id"])
    assert page.evaluate("window.__marker") == 1, "the page reloaded"
    page.screenshot(path=str(ARTIFACTS / "datasets.png"), full_page=True)

    page.goto("/")
    expect(page.locator("main")).to_contain_text("live-list.jsonl")
    page.screenshot(path=str(ARTIFACTS / "home.png"), full_page=True)

    # Pools: the cpu pool's worker is online, and the page is live.
    page.goto("/pools")
    cpu = page.locator('#pools-body tr[data-pool="cpu"]')
    expect(cpu).to_be_visible()
    expect(cpu.locator(".online-count")).to_have_text(re.compile(r"^[1-9]\d* online$"))
    expect(cpu.locator(".hosts-cell")).to_contain_text("online")
    expect(page.locator("#live")).to_have_text("Live", timeout=10_000)
    expect(cpu.locator(".online-count")).to_have_text(re.compile(r"^[1-9]\d* online$"))
    page.screenshot(path=str(ARTIFACTS / "pools.png"), full_page=True)


def test_token_page_shows_secret_once(page: Page, server):
    name = f"browser-{uuid.uuid4().hex[:6]}"
    page.goto("/settings/tokens")
    page.fill("#token-name", name)
    page.click("#create-token")
    secret_box = page.locator("#token-secret")
    expect(secret_box).to_be_visible()
    secret = secret_box.inner_text().strip()
    assert secret.startswith("td_"), secret
    expect(page.locator("#new-token")).to_contain_text("only time")
    page.screenshot(path=str(ARTIFACTS / "token-created.png"), full_page=True)

    me = httpx.get(f"{server.base_url}/api/v1/users/me", headers={"Authorization": f"Bearer {secret}"})
    assert me.status_code == 200 and me.json()["username"] == server.admin_username, me.text

    page.reload()  # a plain GET: the form is not submitted again and the secret is gone
    expect(page.locator("#token-secret")).to_have_count(0)
    assert secret not in page.content()
    row = page.locator("#tokens-table tbody tr", has_text=name)
    expect(row).to_have_count(1)

    page.once("dialog", lambda dialog: dialog.accept())
    with page.expect_navigation():
        row.get_by_role("button", name="Revoke").click()
    expect(page.locator("#tokens-table tbody tr", has_text=name).locator(".pill")).to_have_text("revoked")

    me = httpx.get(f"{server.base_url}/api/v1/users/me", headers={"Authorization": f"Bearer {secret}"})
    assert me.status_code == 401, me.text


def test_a_member_changes_their_password_and_an_admin_disables_them(browser, page: Page, server):
    """The login, password and users pages in a browser (under the CSP like the rest): a member changes
    their password; an admin disables them on the users page, and the member's next page is the login."""
    name, password, token = make_user(server)
    user_id = httpx.get(f"{server.base_url}/api/v1/users/me", headers={"Authorization": f"Bearer {token}"}).json()["id"]
    context = browser.new_context(base_url=server.base_url, viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    watch_page_errors(context, errors)
    member = context.new_page()
    member.goto("/login")
    member.fill("input[name=username]", name)
    member.fill("input[name=password]", password)
    member.click("button[type=submit]")
    member.wait_for_url(f"{server.base_url}/")

    member.click("nav >> text=Password")
    member.wait_for_url(f"{server.base_url}/settings/password")
    new = f"new-{uuid.uuid4().hex}"
    member.fill("#current-password", password)
    member.fill("#new-password", new)
    member.fill("#new-password-again", new)
    member.click("#change-password")
    expect(member.locator(".alert-success")).to_contain_text("Your password was changed")
    member.screenshot(path=str(ARTIFACTS / "password-changed.png"), full_page=True)

    page.goto("/settings/users")
    row = page.locator(f'tr[data-user="{user_id}"]')
    expect(row).to_contain_text(name)
    page.once("dialog", lambda dialog: dialog.accept())
    with page.expect_navigation():
        row.get_by_role("button", name="Disable").click()
    expect(page.locator(f'tr[data-user="{user_id}"] .pill')).to_have_text("disabled")
    page.screenshot(path=str(ARTIFACTS / "users.png"), full_page=True)

    member.goto("/runs")
    expect(member).to_have_url(re.compile(r"/login\?next=/runs$"))
    context.close()
    assert not errors, errors
