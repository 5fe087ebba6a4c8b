"""Evaluations: run checkpoints (one merged for the evaluation), and the base model, served for it by the
run's pool, asked the demo set's prompts, scored against its references; samples browsable and
downloadable; bad requests named and changing nothing."""

import json

import psutil
import sacrebleu
from rouge_score import rouge_scorer

from tests.conftest import make_user, wait_dataset

METRICS = ["exact_match", "normalized_exact_match", "chrf", "rouge_l"]


def wait_evaluation(server, client, evaluation_id: str, timeout: float = 300) -> dict:
    def done():
        e = client.get(f"/api/v1/evaluations/{evaluation_id}").json()
        return e if e["status"] in ("succeeded", "failed", "cancelled") else None

    return server.wait_for(done, timeout=timeout, interval=0.5, what=f"evaluation {evaluation_id}")


def test_checkpoints_and_the_base_are_served_asked_and_scored(server, api, trained_run, artifact):
    run = trained_run
    body = {
        "dataset_id": run["dataset_id"],
        "subjects": [
            {"kind": "checkpoint", "run_id": run["id"], "step": 3},  # not merged yet: merged for it
            {"kind": "base", "run_id": run["id"]},
        ],
        "metrics": METRICS,
        "max_samples": 8,
        "max_tokens": 12,
        "concurrency": 4,
    }
    r = api.post("/api/v1/evaluations", json=body)
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["status"] == "queued" and created["samples_total"] == 16
    assert [s["key"] for s in created["subjects"]] == ["s0", "s1"]
    assert [s.get("step") for s in created["subjects"]] == [3, None]
    ev = wait_evaluation(server, api, created["id"])
    assert ev["status"] == "succeeded", (ev["error"], server.log()[-3000:])
    assert ev["samples_done"] == 16 and ev["chip_seconds"] > 0 and ev["phase"] is None

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
    assert other.get("/api/v1/evaluations").json()["count"] == 0
    assert api.get("/api/v1/evaluations").json()["count"] == before
