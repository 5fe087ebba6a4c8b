"""The data pipeline: chat template, loss masks, truncation, packing/padding, split, batches."""

from __future__ import annotations

import json

import numpy as np
import pytest

from worker.chat import ChatFormat
from worker.training import data

CONVERSATIONS = [
    [
        {"role": "user", "content": "What is the capital of Peru?"},
        {"role": "assistant", "content": "The capital of Peru is Lima."},
    ],
    [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "  Which city is the capital of Chile?\n"},
        {"role": "assistant", "content": "\nThe capital of Chile is Santiago.  "},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! ünïcödé 😀"},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ],
]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return ChatFormat(tiny_model)


def test_tiny_model_tokens_equal_transformers(tok, tiny_model):
    """tiny-gemma4's own files through the one chat implementation equal transformers' reading of them
    (the implementation itself is checked on other templates in tests/test_chat.py)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_model))
    for messages in CONVERSATIONS:
        ids, mask = tok.tokenize(messages)
        expected = hf.apply_chat_template(messages, tokenize=True)
        assert ids.tolist() == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        answers = [m["content"].strip() for m in messages if m["role"] == "assistant"]
        assert tok.decode(ids[mask].tolist()) == "".join(a + "<turn|>" for a in answers)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_tokenize_file_truncates_and_drops(tok, tmp_path):
    long_answer = " ".join(["Paris"] * 100)
    path = _write(
        tmp_path / "d.jsonl",
        [
            {"messages": CONVERSATIONS[0]},
            {
                "messages": [
                    {"role": "user", "content": " ".join(["word"] * 100)},
                    {"role": "assistant", "content": "x"},
                ]
            },
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": long_answer}]},
            {"messages": [{"role": "user", "content": "invalid: no answer"}]},
        ],
    )
    ds = data.tokenize_file(tok, path, "d.jsonl", file_type="jsonl", fmt="chat", max_seq_len=32)
    assert ds.stats == {"records": 3, "examples": 2, "truncated": 2, "dropped_no_target": 1}
    assert len(ds) == 2 and ds.lengths.tolist()[1] == 32
    t, m = ds.example(1)
    assert t[0] == tok.bos_id and m[1:].any()
    # Each example knows its record's line (line 2 lost its answer to the cut; line 4 is invalid), and
    # so does each example of a split: what a run reports as held out for validation.
    assert ds.lines is not None and ds.lines.tolist() == [1, 3]
    train, val = data.split_validation(ds, 0.5, seed=0)
    assert train.lines is not None and val.lines is not None and len(val) == 1
    assert sorted(train.lines.tolist() + val.lines.tolist()) == [1, 3]
    for part in (train, val):
        whole = ds.example(ds.lines.tolist().index(int(part.lines[0])))[0]
        assert part.example(0)[0].tolist() == whole.tolist()


def test_a_record_the_template_cannot_render_names_its_line(tok, tmp_path):
    path = _write(
        tmp_path / "d.jsonl",
        [
            {"messages": CONVERSATIONS[0]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            {"messages": [{"role": "user", "content": "a tool call"}, {"role": "assistant", "content": "a"}]},
        ],
    )
    # a template that refuses a record (as templates do with raise_exception) fails on it, by line
    broken = tmp_path / "model"
    broken.mkdir()
    for f in tok.model_dir.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    (broken / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if 'tool' in m['content'] %}{{ raise_exception('no tool turns here') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ValueError, match=r"d\.jsonl line 3: the base model's chat template failed: no tool turns here"):
        data.tokenize_file(ChatFormat(broken), path, "d.jsonl", file_type="jsonl", fmt="chat", max_seq_len=32)


def _toy_dataset(tok, n=30):
    examples = []
    for i in range(n):
        messages = [
            {"role": "user", "content": f"Say {'ha ' * (i % 7)}number {i}"},
            {"role": "assistant", "content": f"Number {i}."},
        ]
        examples.append(tok.tokenize(messages))
    return data.TokenizedDataset.from_examples(examples)


def test_split_is_deterministic(tok):
    ds = _toy_dataset(tok)
    train1, val1 = data.split_validation(ds, 0.2, seed=3)
    train2, val2 = data.split_validation(ds, 0.2, seed=3)
    _, val3 = data.split_validation(ds, 0.2, seed=4)
    assert (len(train1), len(val1)) == (24, 6)
    assert np.array_equal(val1.tokens, val2.tokens) and np.array_equal(train1.tokens, train2.tokens)
    assert not np.array_equal(val1.tokens, val3.tokens)
    all_examples = sorted(tuple(train1.example(i)[0]) for i in range(len(train1))) + sorted(
        tuple(val1.example(i)[0]) for i in range(len(val1))
    )
    assert sorted(all_examples) == sorted(tuple(ds.example(i)[0]) for i in range(len(ds)))
    assert len(data.split_validation(ds, 0.0, 0)[1]) == 0
    assert len(data.split_validation(ds, 0.001, 0)[1]) == 1  # a positive fraction gives at least one


@pytest.mark.parametrize("packing", [True, False])
def test_batches_have_static_shapes(tok, packing):
    ds = _toy_dataset(tok)
    batches = data.Batches(ds, batch_size=4, max_seq_len=96, packing=packing, pad_id=tok.pad_id, seed=0)
    seen_tokens = 0
    for epoch in range(2):
        out = list(batches.epoch(epoch))
        assert len(out) == batches.batches_in_epoch(epoch)
        for b in out:
            assert b.input_tokens.shape == (4, 96) and b.input_tokens.dtype == np.int32
            assert b.input_mask.shape == (4, 96) and b.input_mask.dtype == bool
            assert not b.input_mask[b.input_tokens == tok.pad_id].any()  # padding never counts
        n_bos = sum(int((b.input_tokens == tok.bos_id).sum()) for b in out)
        assert n_bos == len(ds)  # every example exactly once per epoch
        seen_tokens = sum(data.count_tokens(b, tok.pad_id)[0] for b in out)
        assert seen_tokens == len(ds.tokens)
    if packing:
        assert batches.batches_in_epoch(0) < len(ds) / 4  # several examples per row
        assert max(len(r) for r in batches.rows(0)) > 1
    else:
        assert all(len(r) == 1 for r in batches.rows(0))
    # deterministic order per (seed, epoch); another seed shuffles differently
    again = data.Batches(ds, batch_size=4, max_seq_len=96, packing=packing, pad_id=tok.pad_id, seed=0)
    pairs = zip(batches.epoch(1), again.epoch(1), strict=True)
    assert all(np.array_equal(a.input_tokens, b.input_tokens) for a, b in pairs)
    other = data.Batches(ds, batch_size=4, max_seq_len=96, packing=packing, pad_id=tok.pad_id, seed=1)
    assert not np.array_equal(next(batches.epoch(0)).input_tokens, next(other.epoch(0)).input_tokens)
    stream = list(batches.stream(batches.batches_in_epoch(0) + 2))
    assert np.array_equal(stream[-1].input_tokens, list(batches.epoch(1))[1].input_tokens)


def test_model_inputs_for_packed_rows(tok):
    import jax.numpy as jnp

    a, ma = tok.tokenize(CONVERSATIONS[0])
    b, mb = tok.tokenize(CONVERSATIONS[2])
    ds = data.TokenizedDataset.from_examples([(a, ma), (b, mb)])
    T = len(a) + len(b) + 5
    batch = data.Batches(ds, 1, T, True, tok.pad_id, shuffle=False).make_batch([[0, 1]])
    out = data.model_inputs_fn(tok.pad_id, tok.bos_id)(batch)
    pos = np.asarray(out["positions"])[0]
    att = np.asarray(out["attention_mask"])[0]
    na, nb = len(a), len(b)
    assert pos[:na].tolist() == list(range(na)) and pos[na : na + nb].tolist() == list(range(nb))
    assert (pos[na + nb :] == 0).all()
    assert np.array_equal(att[:na, :na], np.tril(np.ones((na, na), bool)))
    assert np.array_equal(att[na : na + nb, na : na + nb], np.tril(np.ones((nb, nb), bool)))
    assert not att[na : na + nb, :na].any() and not att[:na, na:].any()  # examples never see each other
    assert not att[na + nb :].any() and not att[:, na + nb :].any()  # nor padding
    assert out["input_mask"] is batch.input_mask and isinstance(out["input_tokens"], (np.ndarray, jnp.ndarray))
