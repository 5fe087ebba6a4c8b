"""Evaluations: run checkpoints (one merged for the evaluation), and the base model, served for it by the
run's pool, asked the demo set's prompts, scored against its references; samples browsable and
downloadable; bad requests named and changing nothing."""

import json
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import psutil
import pytest
import sacrebleu
from prometheus_client.parser import text_string_to_metric_families
from rouge_score import rouge_scorer

from tests.api.test_endpoints import model_server, wait_endpoint
from tests.conftest import make_user, wait_dataset

METRICS = ["exact_match", "normalized_exact_match", "chrf", "rouge_l"]


def wait_evaluation(server, client, evaluation_id: str, timeout: float = 300) -> dict:
    def done():
        e = client.get(f"/api/v1/evaluations/{evaluation_id}").json()
        return e if e["status"] in ("succeeded", "failed", "cancelled") else None

    return server.wait_for(done, timeout=timeout, interval=0.5, what=f"evaluation {evaluation_id}")


@pytest.fixture(scope="module")
def checkpoint_evaluation(server, api, trained_run) -> dict:
    """Step 3 (not merged yet: merged for it) and the base, asked 8 prompts and scored, as created."""
    run = trained_run
    body = {
        "dataset_id": run["dataset_id"],
        "subjects": [
            {"kind": "checkpoint", "run_id": run["id"], "step": 3},  # not merged yet: merged for it
            {"kind": "base", "run_id": run["id"]},
        ],
        "metrics": [*METRICS, "perplexity"],
        "max_samples": 8,
        "max_tokens": 12,
        "concurrency": 8,
    }
    r = api.post("/api/v1/evaluations", json=body)
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["status"] == "queued" and created["samples_total"] == 32  # a reply and a scoring each
    assert [s["key"] for s in created["subjects"]] == ["s0", "s1"]
    assert [s.get("step") for s in created["subjects"]] == [3, None]
    return created


def test_checkpoints_and_the_base_are_served_asked_and_scored(server, api, trained_run, checkpoint_evaluation):
    run = trained_run
    ev = wait_evaluation(server, api, checkpoint_evaluation["id"])
    assert ev["status"] == "succeeded", (ev["error"], server.log()[-3000:])
    assert ev["samples_done"] == 32 and ev["chip_seconds"] > 0 and ev["phase"] is None

    for key in ("s0", "s1"):
        for metric in METRICS:
            stat = ev["summary"][key][metric]
            assert stat["n"] == 8 and 0 <= stat["low"] <= stat["mean"] <= stat["high"] <= 1, (key, metric, stat)

    page = api.get(f"/api/v1/evaluations/{ev['id']}/samples", params={"limit": 5}).json()
    assert page["count"] == 8 and [s["position"] for s in page["data"]] == [0, 1, 2, 3, 4]
    samples = api.get(f"/api/v1/evaluations/{ev['id']}/samples", params={"limit": 100}).json()["data"]
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    for s in samples:
        assert s["messages"][-1]["role"] == "user" and s["reference"].startswith("The capital of")
        assert set(s["outputs"]) == {"s0", "s1"} and all(isinstance(o, str) for o in s["outputs"].values())
        for key, out in s["outputs"].items():  # scored as the reference libraries score
            scores = s["scores"][key]
            assert scores["chrf"] == sacrebleu.sentence_chrf(out, [s["reference"]]).score / 100
            assert scores["rouge_l"] == scorer.score(s["reference"], out)["rougeL"].fmeasure
            assert scores["exact_match"] == float(out.strip() == s["reference"].strip())
    means = {k: sum(s["scores"][k]["chrf"] for s in samples) / 8 for k in ("s0", "s1")}
    assert all(abs(ev["summary"][k]["chrf"]["mean"] - means[k]) < 1e-9 for k in means)

    # Where the subjects differ most, first.
    spread = api.get(f"/api/v1/evaluations/{ev['id']}/samples", params={"order": "spread"}).json()["data"]
    assert [s["spread"] for s in spread] == sorted((s["spread"] for s in samples), reverse=True)
    assert spread[0]["spread"] > 0

    # The download holds the same rows, a JSON object a line.
    r = api.get(f"/api/v1/evaluations/{ev['id']}/samples.jsonl")
    assert r.status_code == 200 and "attachment" in r.headers["content-disposition"]
    assert [json.loads(line) for line in r.text.splitlines()] == samples

    # Step 3 was merged for the evaluation (a merged artifact of the run now), and what served the
    # subjects was stopped after.
    merged = [
        a for a in api.get("/api/v1/artifacts", params={"run_id": run["id"]}).json()["data"] if a["kind"] == "merged"
    ]
    assert sorted(a["checkpoint_step"] for a in merged if a["status"] == "succeeded")[:1] == [3]
    left = [p for p in psutil.process_iter(["cmdline"]) if ev["id"] in " ".join(p.info["cmdline"] or [])]
    assert not left, [p.info["cmdline"] for p in left]

    listed = api.get("/api/v1/evaluations", params={"run_id": run["id"]}).json()
    assert ev["id"] in [e["id"] for e in listed["data"]]
    assert api.post(f"/api/v1/evaluations/{ev['id']}/cancel").status_code == 409

    # The run compared by its evaluations: this eval set (the dataset's first 8 conversations) has a row
    # per subject, with the summary's scores and the evaluation's cost; one run, so no settings differ.
    compared = api.get("/api/v1/evaluations/compare", params={"run_ids": run["id"]}).json()
    (group,) = [g for g in compared["data"] if g["eval_set"] == f"{run['dataset_id']}:8"]
    assert group["samples"] == 8 and group["config_differences"] == {} and group["metrics"][: len(METRICS)] == METRICS
    assert [(r["kind"], r["run_id"], r["step"], r["evaluation_id"]) for r in group["rows"]] == [
        ("checkpoint", run["id"], 3, ev["id"]),
        ("base", None, None, ev["id"]),
    ]
    for row, key in zip(group["rows"], ("s0", "s1"), strict=True):
        assert row["scores"] == {m: v for m, v in ev["summary"][key].items()}
        assert row["chip_seconds"] == ev["chip_seconds"] and row["cost_usd"] == ev["cost_usd"]


def test_the_references_perplexity_is_what_transformers_computes(server, api, trained_run, checkpoint_evaluation):
    """The references' perplexity under step 3, as transformers computes it: the reference's tokens are
    those the checkpoint's chat template gives the answer, its end-of-turn marker included."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ev = wait_evaluation(server, api, checkpoint_evaluation["id"])
    samples = api.get(f"/api/v1/evaluations/{ev['id']}/samples", params={"limit": 100}).json()["data"]
    (step3,) = [
        a
        for a in api.get("/api/v1/artifacts", params={"run_id": trained_run["id"]}).json()["data"]
        if a["kind"] == "merged" and a["checkpoint_step"] == 3 and a["status"] == "succeeded"
    ]
    tok = AutoTokenizer.from_pretrained(step3["path"])
    hf = AutoModelForCausalLM.from_pretrained(step3["path"], dtype=torch.float32)
    end_of_turn = tok.convert_tokens_to_ids("<turn|>")
    total_nll = total_tokens = 0.0
    for s in samples:
        answered = [*s["messages"], {"role": "assistant", "content": s["reference"]}]
        encode = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731 - the template has <bos>
        prompt = encode(tok.apply_chat_template(s["messages"], tokenize=False, add_generation_prompt=True))
        ids = encode(tok.apply_chat_template(answered, tokenize=False))
        assert ids[: len(prompt)] == prompt
        targets = range(len(prompt), ids.index(end_of_turn, len(prompt)) + 1)
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        nll = -sum(float(logp[k - 1, ids[k]]) for k in targets)
        assert s["scores"]["s0"]["perplexity"] == pytest.approx(math.exp(nll / len(targets)), rel=1e-3)
        total_nll, total_tokens = total_nll + nll, total_tokens + len(targets)
    ppl = ev["summary"]["s0"]["perplexity"]
    assert ppl["tokens"] == total_tokens and ppl["mean"] == pytest.approx(math.exp(total_nll / total_tokens), rel=1e-3)
    assert ppl["low"] <= ppl["mean"] <= ppl["high"] and ev["summary"]["s1"]["perplexity"]["n"] == 8


def test_bad_evaluations_are_named_and_change_nothing(server, api, trained_run):
    run = trained_run
    before = api.get("/api/v1/evaluations").json()["count"]
    ok = {"dataset_id": run["dataset_id"], "subjects": [{"kind": "checkpoint", "run_id": run["id"]}]}
    for change, field, words in (
        ({"metrics": ["bleurt"]}, "metrics", "unknown metric 'bleurt'"),
        ({"metrics": ["regex_match"]}, "body", "regex_match needs a regex"),
        ({"metrics": ["regex_match"], "regex": "(unclosed"}, "body", "regex"),
        (
            {"subjects": [{"kind": "checkpoint", "run_id": run["id"], "step": 4}]},
            "subjects.0",
            "no checkpoint at step 4",
        ),
        ({"subjects": [{"kind": "endpoint"}]}, "subjects", "names its endpoint_id"),
        ({"subjects": []}, "subjects", "at least 1"),
        ({"max_samples": 0}, "max_samples", "greater than or equal to 1"),
        (
            {"subjects": [{"kind": "checkpoints", "run_id": run["id"], "step": 3}]},
            "subjects.0",
            "leave step out",
        ),
        ({"judge": {"url": "http://127.0.0.1:9/v1"}}, "judge", "names the model to ask there"),
        ({"judge": {"url": "ftp://x", "model": "m"}}, "judge", "starts with http:// or https://"),
        ({"judge": {"endpoint_id": "ep-1", "url": "http://x/v1", "model": "m"}}, "judge", "either an endpoint"),
        ({"judge": {"endpoint_id": "ep-1", "api_key": "k"}}, "judge", "its own model and key"),
        ({"judge": {"url": "http://x/v1", "model": "m", "rubric": "kindness"}}, "judge", "unknown rubric 'kindness'"),
        ({"judge": {"url": "http://x/v1", "model": "m", "prompt": "Good?"}}, "judge", "put {answer} in it"),
        ({"judge": {"url": "http://x/v1", "model": "m", "pairwise": True}}, "judge.pairwise", "at least two"),
        ({"validation_of": run["id"]}, "body", "name the eval set: a dataset (dataset_id) or a run's validation"),
        ({"dataset_id": None}, "body", "name the eval set"),
    ):
        r = api.post("/api/v1/evaluations", json={**ok, **change})
        assert r.status_code == 422, (change, r.text)
        detail = r.json()["detail"][0]
        assert field in ".".join(map(str, detail["loc"])) and words in detail["msg"], (change, detail)

    # A text dataset has no reference answers: the reference-based metric is named.
    text = api.post("/api/v1/datasets", files={"file": ("notes.jsonl", b'{"text": "a note"}\n{"text": "another"}\n')})
    dataset = wait_dataset(server, api, text.json()["id"])
    assert dataset["status"] == "ready" and dataset["format"] == "text", dataset
    r = api.post("/api/v1/evaluations", json={**ok, "dataset_id": dataset["id"], "metrics": ["chrf"]})
    assert r.status_code == 422 and "chrf compares replies with reference answers" in r.text, r.text

    # Every subject and the eval set must be the caller's: 404 for someone else.
    _, _, token = make_user(server)
    other = server.client(token)
    r = other.post("/api/v1/evaluations", json=ok)
    assert r.status_code == 404 and "not found" in r.json()["detail"], r.text
    mine = other.post("/api/v1/datasets/demo").json()["id"]
    wait_dataset(server, other, mine)
    for subject in ({"kind": "checkpoint", "run_id": run["id"]}, {"kind": "base", "run_id": run["id"]}):
        r = other.post("/api/v1/evaluations", json={"dataset_id": mine, "subjects": [subject]})
        assert r.status_code == 404 and f"run '{run['id']}' not found" in r.json()["detail"], r.text
    r = other.post(
        "/api/v1/evaluations", json={"dataset_id": mine, "subjects": [{"kind": "endpoint", "endpoint_id": "ep-x"}]}
    )
    assert r.status_code == 404, r.text
    r = other.post(
        "/api/v1/evaluations",
        json={"validation_of": run["id"], "subjects": [{"kind": "base", "base_model": "tiny-gemma4"}]},
    )
    assert r.status_code == 404 and f"run '{run['id']}' not found" in r.json()["detail"], r.text
    r = other.post(
        "/api/v1/evaluations",
        json={
            "dataset_id": mine,
            "subjects": [{"kind": "base", "base_model": "tiny-gemma4"}],
            "judge": {"endpoint_id": "ep-x"},
        },
    )
    assert r.status_code == 404 and "endpoint 'ep-x' not found" in r.json()["detail"], r.text  # the judge
    r = other.get("/api/v1/evaluations/compare", params={"run_ids": run["id"]})  # nor compare someone's runs
    assert r.status_code == 404 and f"run '{run['id']}' not found" in r.json()["detail"], r.text
    assert other.get("/api/v1/evaluations").json()["count"] == 0
    assert api.get("/api/v1/evaluations").json()["count"] == before


@pytest.fixture(scope="module")
def judge_endpoint(server, api, artifact) -> dict:
    """A ready endpoint of the tiny model, to be the judge (and a subject); stopped after the module."""
    yield from _served(server, api, artifact["id"])


def _served(server, api, artifact_id: str):
    """A fixture's ready endpoint of the artifact, stopped after. Every one has the same settings, so the
    programs the first compiled (in the persistent cache) serve the others too."""
    r = api.post("/api/v1/endpoints", json={"artifact_id": artifact_id, "max_model_len": 1024, "max_num_seqs": 8})
    assert r.status_code == 201, r.text
    endpoint = wait_endpoint(server, api, r.json()["id"], ("ready", "failed"))
    assert endpoint["status"] == "ready", endpoint["error"]
    yield endpoint
    api.post(f"/api/v1/endpoints/{endpoint['id']}/stop")
    wait_endpoint(server, api, endpoint["id"], ("stopped", "failed"))


def finished_requests(endpoint: dict) -> float:
    """Requests the endpoint's model server has answered (vllm:request_success_total, every reason)."""
    key = model_server(endpoint).environ()["VLLM_API_KEY"]
    text = httpx.get(f"{endpoint['url']}/metrics", headers={"Authorization": f"Bearer {key}"}).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:request_success_total"
    )


def test_a_judge_endpoint_grades_every_answer_and_compares_answers_in_both_orders(
    server, api, trained_run, judge_endpoint
):
    """Another Tunedeck endpoint as the judge: the tiny model's verdicts are noise, so what is checked is
    the plumbing. Every answer is graded, each pair judged in both orders, every verdict read or counted
    as unparsable, and the judge asked exactly that often."""
    before = finished_requests(judge_endpoint)
    body = {
        "dataset_id": trained_run["dataset_id"],
        # The endpoint twice (no other model server to start): the judge still grades both, and
        # compares their answers in both orders.
        "subjects": [{"kind": "endpoint", "endpoint_id": judge_endpoint["id"]}] * 2,
        "metrics": ["exact_match"],
        "max_samples": 4,
        "max_tokens": 8,
        "judge": {"endpoint_id": judge_endpoint["id"], "pairwise": True, "max_tokens": 24},
    }
    r = api.post("/api/v1/evaluations", json=body)
    assert r.status_code == 201, r.text
    assert r.json()["samples_total"] == 4 * (2 + 2 + 2)  # replies, grades, verdicts in both orders
    ev = wait_evaluation(server, api, r.json()["id"])
    assert ev["status"] == "succeeded", (ev["error"], server.log()[-3000:])
    # As the subjects 2 x 4 replies; as the judge 1 check, 2 x 4 grades, 2 x 4 pairwise verdicts (its
    # prober adds requests of its own: at least these; exactly these is the next test's, at a judge of its own).
    assert ev["samples_done"] == 24 and finished_requests(judge_endpoint) - before >= 8 + 1 + 8 + 8

    for key in ("s0", "s1"):
        graded = ev["summary"][key]["judge"]
        assert graded["n"] + graded["unparsable"] == 4, graded
    pair = ev["summary"]["pairwise"]["s0:s1"]
    assert pair["n"] + pair["unparsable"] == 4, pair
    samples = api.get(f"/api/v1/evaluations/{ev['id']}/samples").json()["data"]
    for s in samples:
        assert set(s["judgements"]) == {"s0", "s1", "s0:s1"}
        for key in ("s0", "s1"):
            verdict = s["judgements"][key]
            assert ("unparsable" in verdict) != ("score" in verdict and "judge" in s["scores"][key]), verdict
        compared = s["judgements"]["s0:s1"]
        assert len(compared.get("unparsable") or compared["orders"]) == 2, compared


class _Judge(BaseHTTPRequestHandler):
    """An OpenAI-compatible judge of the test's own: it grades 6, but answers in words where the
    question begins "Which city"; it always prefers whichever answer it is shown first (position bias).
    Under /html/ it answers a web page instead."""

    seen: list[tuple[str, dict]] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Judge.seen.append((self.headers.get("Authorization", ""), body))
        if self.path.startswith("/html/"):
            return self._send(b"<html><body>Welcome</body></html>", "text/html")
        prompt = body["messages"][-1]["content"]
        if prompt == "Reply with OK.":
            content = "OK"
        elif '"winner"' in prompt:
            content = json.dumps({"winner": "A", "reason": "the first one reads better"})
        elif "Which city" in prompt:
            content = "It deserves a 7."
        else:
            content = json.dumps({"score": 6, "reason": "mostly right"})
        reply = {"id": "j", "object": "chat.completion", "model": body["model"], "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        ]}  # fmt: skip
        self._send(json.dumps(reply).encode(), "application/json")

    def _send(self, data: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def judge_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_judge_at_a_url_gets_its_key_unseen_and_its_verdicts_read_strictly(
    server, api, trained_run, judge_endpoint, judge_url
):
    _Judge.seen.clear()
    body = {
        "dataset_id": trained_run["dataset_id"],
        "subjects": [{"kind": "endpoint", "endpoint_id": judge_endpoint["id"]}] * 2,
        "metrics": ["exact_match"],
        "max_samples": 6,
        "max_tokens": 8,
        "judge": {"url": f"{judge_url}/v1", "model": "grader", "api_key": "sk-judge-secret", "pairwise": True},
    }
    r = api.post("/api/v1/evaluations", json=body)
    assert r.status_code == 201, r.text
    ev = wait_evaluation(server, api, r.json()["id"])
    assert ev["status"] == "succeeded", (ev["error"], server.log()[-3000:])
    # The key reached the judge, and nobody else: never in a reply, sealed in the database.
    assert ev["config"]["judge"]["api_key"] == "(set)"
    assert {auth for auth, _ in _Judge.seen} == {"Bearer sk-judge-secret"}
    assert {b["model"] for _, b in _Judge.seen} == {"grader"} and len(_Judge.seen) == 1 + 6 * 2 + 6 * 2
    for reply in (r.text, api.get(f"/api/v1/evaluations/{ev['id']}").text, api.get("/api/v1/evaluations").text):
        assert "sk-judge-secret" not in reply
    ((sealed,),) = server.sql("SELECT judge_key FROM evaluations WHERE id = :id", id=ev["id"])
    assert sealed and "sk-judge-secret" not in sealed

    samples = api.get(f"/api/v1/evaluations/{ev['id']}/samples").json()["data"]
    worded = sum("Which city" in s["messages"][-1]["content"] for s in samples)
    assert 0 < worded < 6, "the demo set asks its questions in several ways"
    for key in ("s0", "s1"):
        graded = ev["summary"][key]["judge"]
        assert (graded["n"], graded["unparsable"]) == (6 - worded, worded)
        assert graded["mean"] == pytest.approx(5 / 9)  # a 6 of 1-10 on the [0, 1] scale
    for s in samples:
        if "Which city" in s["messages"][-1]["content"]:
            assert s["judgements"]["s0"] == {"unparsable": "It deserves a 7."}
        else:
            assert s["judgements"]["s0"] == {"score": 6, "reason": "mostly right"}
    # A judge that always picks the answer shown first is right about neither: every pair is a tie.
    pair = ev["summary"]["pairwise"]["s0:s1"]
    assert (pair["n"], pair["tie"], pair["unparsable"]) == (6, 6, 0) and pair["win_rate_ci"][0] == 0.0
    assert all(s["judgements"]["s0:s1"]["orders"] == ["A", "B"] for s in samples)


def test_a_runs_validation_split_is_the_records_its_training_held_out(server, api, trained_run, judge_endpoint):
    """`validation_of`: the eval set is what the run's validation_fraction kept out of training, the
    records it named by line when it split its file (the demo file's 10%), nothing it trained on."""
    from app.datasets.demo import demo_dataset_jsonl

    ((held,),) = server.sql("SELECT held_out_lines FROM runs WHERE id = :id", id=trained_run["id"])
    held = json.loads(held) if isinstance(held, str) else held
    records = demo_dataset_jsonl().decode().splitlines()
    assert len(held) == round(0.1 * len(records)) and held == sorted(set(held)), held
    body = {
        "validation_of": trained_run["id"],
        "subjects": [{"kind": "endpoint", "endpoint_id": judge_endpoint["id"]}],
        "metrics": ["exact_match"],
        "max_samples": 1000,
        "max_tokens": 4,
    }
    r = api.post("/api/v1/evaluations", json=body)
    assert r.status_code == 201, r.text
    assert r.json()["dataset_id"] == trained_run["dataset_id"] and r.json()["samples_total"] == len(held)
    ev = wait_evaluation(server, api, r.json()["id"])
    assert ev["status"] == "succeeded", (ev["error"], server.log()[-3000:])
    samples = api.get(f"/api/v1/evaluations/{ev['id']}/samples", params={"limit": 1000}).json()["data"]
    expected = [json.loads(records[line - 1])["messages"] for line in held]
    assert [s["messages"] for s in samples] == [m[:-1] for m in expected]
    assert [s["reference"] for s in samples] == [m[-1]["content"] for m in expected]


def test_a_judge_that_cannot_answer_fails_the_evaluation_before_any_subject_is_served(
    server, api, trained_run, judge_url
):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    for url, words in ((closed, "did not answer: ConnectError"), (f"{judge_url}/html/v1", "OpenAI chat completion")):
        body = {
            "dataset_id": trained_run["dataset_id"],
            "subjects": [{"kind": "base", "run_id": trained_run["id"]}],
            "judge": {"url": url, "model": "grader"},
        }
        r = api.post("/api/v1/evaluations", json=body)
        assert r.status_code == 201, r.text
        ev = wait_evaluation(server, api, r.json()["id"], timeout=60)
        assert ev["status"] == "failed" and f"the judge at {url}" in ev["error"] and words in ev["error"], ev
        assert ev["samples_done"] == 0 and ev["chip_seconds"] == 0, "no subject was served"


def test_a_checkpoints_subject_is_every_checkpoint_of_the_run_in_step_order(server, api, trained_run):
    r = api.post(
        "/api/v1/evaluations",
        json={
            "dataset_id": trained_run["dataset_id"],
            "subjects": [{"kind": "checkpoints", "run_id": trained_run["id"]}],
        },
    )
    assert r.status_code == 201, r.text
    subjects = r.json()["subjects"]
    assert [(s["key"], s["kind"], s["step"], s["sweep"]) for s in subjects] == [
        ("s0", "checkpoint", 3, True),
        ("s1", "checkpoint", 6, True),
    ]
    assert [s["label"] for s in subjects] == [f"{trained_run['id']} step 3", f"{trained_run['id']} step 6"]
    assert api.post(f"/api/v1/evaluations/{r.json()['id']}/cancel").status_code == 200


@pytest.fixture(scope="module")
def step3_endpoint(server, api, trained_run, checkpoint_evaluation) -> dict:
    """The step-3 merge (made for the checkpoint evaluation) served: a second model beside the judge's."""
    assert wait_evaluation(server, api, checkpoint_evaluation["id"])["status"] == "succeeded"
    (step3,) = [
        a
        for a in api.get("/api/v1/artifacts", params={"run_id": trained_run["id"]}).json()["data"]
        if a["kind"] == "merged" and a["checkpoint_step"] == 3 and a["status"] == "succeeded"
    ]
    yield from _served(server, api, step3["id"])


def _answer(api, battle_id: str, side: str) -> tuple[str, str]:
    """Stream one side's answer: (its text put together from the token events, the raw stream)."""
    with api.stream("POST", f"/api/v1/arena/battles/{battle_id}/answers/{side}") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        raw = r.read().decode().replace("\r\n", "\n")
    events = [
        (e.split("event: ", 1)[1].split("\n", 1)[0], json.loads(e.split("data: ", 1)[1].split("\n", 1)[0]))
        for e in raw.split("\n\n")
        if e.startswith("event: ")
    ]
    assert events and events[-1][0] == "done" and all(name == "token" for name, _ in events[:-1]), raw
    return "".join(data["text"] for _, data in events[:-1]), raw


def test_the_arena_hides_names_until_the_vote_rates_models_and_exports_votes_as_preferences(
    server, api, trained_run, artifact, judge_endpoint, step3_endpoint
):
    pair = [judge_endpoint["id"], step3_endpoint["id"]]
    models = {judge_endpoint["model"], step3_endpoint["model"]}
    before = api.get("/api/v1/arena/battles").json()["count"]
    votes_before = api.get("/api/v1/arena/leaderboard").json()["votes"]  # the browser tests' may share the server
    for body, status, words in [
        ({"endpoint_ids": [pair[0], pair[0]], "prompt": "hi"}, 422, "two different endpoints"),
        ({"endpoint_ids": pair, "prompt": "hi", "dataset_id": trained_run["dataset_id"], "position": 0}, 422, "either"),
        ({"endpoint_ids": [pair[0], "ep-nope"], "prompt": "hi"}, 404, "endpoint 'ep-nope' not found"),
        (
            {"endpoint_ids": pair, "dataset_id": trained_run["dataset_id"], "position": 10**6},
            422,
            "conversations with a reply",
        ),
    ]:
        r = api.post("/api/v1/arena/battles", json=body)
        assert r.status_code == status and words in r.text, (body, r.text)
    assert api.get("/api/v1/arena/battles").json()["count"] == before

    votes = ["a", "b", "a", "tie"]
    outcomes = []  # (side a's model, side b's model, vote)
    for i, vote in enumerate(votes):
        body = {"endpoint_ids": pair, "max_tokens": 6}
        body |= (
            {"prompt": f"Capital of country {i}?"} if i else {"dataset_id": trained_run["dataset_id"], "position": 2}
        )
        r = api.post("/api/v1/arena/battles", json=body)
        assert r.status_code == 201, r.text
        battle = r.json()
        assert battle["sides"] is None and battle["messages"][-1]["role"] == "user"
        assert not models & set(json.dumps(battle).split('"')), "no model is named before the vote"
        if i == 0:  # the eval set's third conversation, without its reply
            assert battle["messages"][-1]["content"].startswith("What is the capital of")
            r = api.post(f"/api/v1/arena/battles/{battle['id']}/vote", json={"vote": "a"})
            assert r.status_code == 409 and "side a has not answered yet" in r.text, r.text
        answers = {}
        for side in ("a", "b"):
            answers[side], raw = _answer(api, battle["id"], side)
            assert not any(m in raw for m in models), "no event names the model"
        stored = api.get(f"/api/v1/arena/battles/{battle['id']}").json()
        assert stored["outputs"] == answers and stored["sides"] is None
        r = api.post(f"/api/v1/arena/battles/{battle['id']}/vote", json={"vote": vote})
        assert r.status_code == 200, r.text
        sides = r.json()["sides"]
        assert {s["endpoint_id"] for s in sides} == set(pair) and {s["model"] for s in sides} == models
        outcomes.append((sides[0]["model"], sides[1]["model"], vote))
    again = api.post(f"/api/v1/arena/battles/{battle['id']}/vote", json={"vote": "b"})
    assert again.status_code == 409 and "already voted on (tie)" in again.text
    assert api.post(f"/api/v1/arena/battles/{battle['id']}/answers/a").status_code == 409

    board = api.get("/api/v1/arena/leaderboard").json()
    assert board["votes"] == votes_before + 4
    mine = [row for row in board["data"] if row["model"] in models]  # no other battle had these two
    assert len(mine) == 2
    for row in mine:
        m = row["model"]
        wins = sum((a == m and v == "a") or (b == m and v == "b") for a, b, v in outcomes)
        losses = sum((a == m and v == "b") or (b == m and v == "a") for a, b, v in outcomes)
        assert (row["battles"], row["wins"], row["losses"], row["ties"]) == (4, wins, losses, 1), (row, outcomes)
    a_wins = {row["model"]: row["wins"] for row in mine}
    (top, bottom) = mine
    assert a_wins[top["model"]] >= a_wins[bottom["model"]] and top["bt"] >= bottom["bt"]

    # The votes with a winner (and two answers that are not blank: the tiny model's may be), as a
    # preference dataset that validates...
    battles = api.get("/api/v1/arena/battles").json()["data"]
    pairs = [b for b in battles if b["vote"] in ("a", "b") and all(o.strip() for o in b["outputs"].values())]
    assert pairs, battles
    r = api.post("/api/v1/arena/export", json={"name": "votes"})
    assert r.status_code == 201, r.text
    exported = wait_dataset(server, api, r.json()["id"])
    assert (exported["status"], exported["format"], exported["rows"], exported["filename"]) == (
        "ready",
        "preference",
        len(pairs),
        "votes.jsonl",
    ), exported
    rows = [json.loads(line) for line in api.get(f"/api/v1/datasets/{exported['id']}/content").text.splitlines()]
    # ... which TRL's preference trainers take as it is: conversational, and rendered by the model's own
    # chat template into a prompt that ends where the answers begin.
    from transformers import AutoTokenizer
    from trl.data_utils import is_conversational, maybe_apply_chat_template

    tokenizer = AutoTokenizer.from_pretrained(artifact["path"])
    for row in rows:
        assert is_conversational(row)
        text = maybe_apply_chat_template(row, tokenizer)
        prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        assert text["prompt"] == prompt and row["chosen"][0]["content"].strip() in text["chosen"], text
    # ... and a run refuses it, naming the field.
    r = api.post("/api/v1/runs", json={"dataset_id": exported["id"]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "dataset_id"], r.text
    assert "preference pairs" in r.json()["detail"][0]["msg"]


def _stream_by_name(server, model: str, stop: threading.Event, results: list) -> None:
    """Stream chat completions of `model` through the gateway until `stop`: one (ok, what) per request."""
    body = {"model": model, "messages": [{"role": "user", "content": "Capital of Chad?"}], "max_tokens": 8}
    with server.client() as client:
        while not stop.is_set():
            try:
                with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
                    lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                chunks = [json.loads(line[6:]) for line in lines[:-1]]
                ok = r.status_code == 200 and lines[-1:] == ["data: [DONE]"] and not any("error" in c for c in chunks)
                results.append((ok, r.status_code if ok else (r.status_code, lines[-3:])))
            except httpx.HTTPError as exc:
                results.append((False, repr(exc)))
            stop.wait(0.05)  # a client in a loop, not a load test: the switch is what is tested


def test_promoting_a_checkpoint_into_an_endpoints_place_loses_no_request(
    server, api, trained_run, checkpoint_evaluation, judge_endpoint
):
    """Clients stream the endpoint's model by name throughout. The evaluated step-3 checkpoint is promoted
    into the place of the endpoint serving step 6: the gateway moves the name over once the new endpoint
    is ready, the old one stops after, and not one request fails."""
    ev = wait_evaluation(server, api, checkpoint_evaluation["id"])
    old = judge_endpoint
    (step3,) = [
        a
        for a in api.get("/api/v1/artifacts", params={"run_id": trained_run["id"]}).json()["data"]
        if a["kind"] == "merged" and a["checkpoint_step"] == 3 and a["status"] == "succeeded"
    ]
    url = f"/api/v1/evaluations/{ev['id']}/promote"
    r = api.post(url, json={"subject": "s1", "endpoint_id": old["id"]})
    assert r.status_code == 422 and "only a checkpoint is promoted" in r.text, r.text  # s1 is the base
    r = api.post(url, json={"subject": "s7", "endpoint_id": old["id"]})
    assert r.status_code == 422 and "no subject 's7' (s0, s1)" in r.text, r.text
    r = api.post(url, json={"subject": "s0", "endpoint_id": "ep-nope"})
    assert r.status_code == 404 and "endpoint 'ep-nope' not found" in r.text, r.text

    results: list = []
    stop = threading.Event()
    clients = [threading.Thread(target=_stream_by_name, args=(server, old["model"], stop, results)) for _ in range(2)]
    for c in clients:
        c.start()
    new = None
    try:
        server.wait_for(lambda: len(results) >= 6, timeout=60, what="requests before the promotion")
        r = api.post(url, json={"subject": "s0", "endpoint_id": old["id"]})
        assert r.status_code == 201, r.text
        new = r.json()
        assert (new["replaces_id"], new["model"], new["artifact_id"]) == (old["id"], old["model"], step3["id"])
        again = api.post(url, json={"subject": "s0", "endpoint_id": old["id"]})
        assert again.status_code == 409 and f"{new['id']} is already replacing" in again.text, again.text
        assert wait_endpoint(server, api, new["id"], ("ready", "failed"))["status"] == "ready"
        assert wait_endpoint(server, api, old["id"], ("stopped", "failed"))["status"] == "stopped"
        switched = len(results)
        server.wait_for(lambda: len(results) >= switched + 6, timeout=60, what="requests after the old one stopped")
    finally:
        stop.set()
        for c in clients:
            c.join()
    failed = [what for ok, what in results if not ok]
    assert not failed, failed

    def gateway_samples(endpoint_id):  # written in batches, within half a second of the reply's end
        return [s for s in api.get(f"/api/v1/endpoints/{endpoint_id}/samples").json() if s["source"] == "gateway"]

    server.wait_for(
        lambda: len(gateway_samples(old["id"])) + len(gateway_samples(new["id"])) == len(results),
        timeout=10,
        what="a gateway sample per request",
    )
    served = {e: gateway_samples(e) for e in (old["id"], new["id"])}
    assert all(served.values()), "both endpoints served the name in turn"
    assert {s["status_code"] for samples in served.values() for s in samples} == {200}
    assert max(s["at"] for s in served[old["id"]]) <= max(s["at"] for s in served[new["id"]])
    api.post(f"/api/v1/endpoints/{new['id']}/stop")
    wait_endpoint(server, api, new["id"], ("stopped", "failed"))
