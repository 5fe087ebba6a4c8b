"""The official openai package against Tunedeck's /v1/files."""

import json

import openai
import pytest
from openai import OpenAI

from tests.conftest import wait_dataset

CHAT = "".join(
    json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}) + "\n"
    for i in range(10)
).encode()


def test_files_lifecycle_with_openai_sdk(server, api):
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key=server.admin_token)
    created = client.files.create(file=("train.jsonl", CHAT), purpose="fine-tune")
    assert created.id and created.filename == "train.jsonl" and created.bytes == len(CHAT)
    assert created.purpose == "fine-tune"
    wait_dataset(server, api, created.id)
    assert client.files.retrieve(created.id).status == "processed"
    assert created.id in [f.id for f in client.files.list()]
    assert client.files.content(created.id).read() == CHAT
    deleted = client.files.delete(created.id)
    assert deleted.deleted and deleted.id == created.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)


def test_invalid_file_reports_error_status(server, api):
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key=server.admin_token)
    created = client.files.create(file=("bad.jsonl", CHAT + b"{not json\n"), purpose="fine-tune")
    wait_dataset(server, api, created.id)
    got = client.files.retrieve(created.id)
    assert got.status == "error" and "line 11" in got.status_details and "invalid JSON" in got.status_details


def test_wrong_purpose_and_bad_token(server):
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key=server.admin_token)
    with pytest.raises(openai.UnprocessableEntityError, match="purpose"):
        client.files.create(file=("x.jsonl", CHAT), purpose="assistants")
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{server.base_url}/v1", api_key="td_wrong").files.list()


def test_list_pagination_cursor(server, api):
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key=server.admin_token)
    ids = [client.files.create(file=(f"c{i}.jsonl", CHAT), purpose="fine-tune").id for i in range(3)]
    first = client.files.list(limit=2)
    assert [f.id for f in first.data] == ids[::-1][:2] and first.has_more
    after = client.files.list(limit=1, after=first.data[-1].id)
    assert after.data[0].id == ids[0]
