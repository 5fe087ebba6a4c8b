"""A checkpoint laid out like Google's Gemma 4 release (made by the test from the release's published
format, not by Tunedeck) goes through the whole chain on the cpu pool: registered as a base model,
trained, merged, deployed, and chatted with through the gateway, where the prompt is what transformers'
apply_chat_template makes of the checkpoint's own template and the reply stops at <turn|>."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests import checkpoints
from tests.api.test_artifacts import wait_artifact
from tests.api.test_endpoints import deploy, wait_endpoint
from tests.api.test_runs_lifecycle import demo_dataset, wait_run

MESSAGES = [
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    # <turn|> made likely after a couple of tokens, so that the greedy reply ends its turn (the run's
    # learning rate is low enough to keep it so: this test follows the formats, not the learning)
    return checkpoints.write_gemma4_release(tmp_path_factory.mktemp("hub") / "gemma-4-tiny-it", end_of_turn_bias=0.5)


def test_a_release_checkpoint_trains_merges_serves_and_stops_at_end_of_turn(server, api, release):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = api.post(
        "/api/v1/base-models", json={"name": "gemma4-release", "preset": "tiny-gemma4", "source": str(release)}
    )
    assert r.status_code == 201, r.text
    config = {"max_steps": 4, "batch_size": 8, "max_seq_len": 64, "checkpoint_every_steps": 4, "learning_rate": 1e-5}
    r = api.post(
        "/api/v1/runs", json={"base_model": "gemma4-release", "dataset_id": demo_dataset(server, api), "config": config}
    )
    assert r.status_code == 201, r.text
    run = wait_run(server, api, r.json()["id"])
    assert run["status"] == "succeeded", (run["error"], server.log()[-3000:])
    (merged,) = [
        a for a in api.get("/api/v1/artifacts", params={"run_id": run["id"]}).json()["data"] if a["kind"] == "merged"
    ]
    merged = wait_artifact(server, api, merged["id"])
    assert merged["status"] == "succeeded", merged["error"]
    endpoint = deploy(server, api, merged)
    assert endpoint["status"] == "ready", (endpoint["error"], server.log()[-3000:])
    try:
        gateway = OpenAI(base_url=f"{server.base_url}/v1", api_key=server.admin_token)
        reply = gateway.chat.completions.create(model=merged["name"], messages=MESSAGES, max_tokens=32, temperature=0)

        # the reference: transformers reading the merged checkpoint's own files
        tok = AutoTokenizer.from_pretrained(merged["path"])
        prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True, return_tensors="pt")
        assert reply.usage.prompt_tokens == prompt["input_ids"].shape[1]
        model = AutoModelForCausalLM.from_pretrained(merged["path"], dtype=torch.float32)
        out = model.generate(**prompt, max_new_tokens=32, do_sample=False)[0, prompt["input_ids"].shape[1] :].tolist()
        turn_end = tok.convert_tokens_to_ids("<turn|>")
        assert turn_end in out, (
            f"the reference reply never ends its turn, so the check below would prove nothing: {out}"
        )
        ended = out.index(turn_end)
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens == ended + 1  # the end of turn counts, as in vLLM
        assert reply.choices[0].message.content == tok.decode(out[:ended], skip_special_tokens=True)
    finally:
        api.post(f"/api/v1/endpoints/{endpoint['id']}/stop")
        wait_endpoint(server, api, endpoint["id"], ("stopped", "failed"))
