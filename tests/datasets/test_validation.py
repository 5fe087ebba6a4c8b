"""Tests for app.datasets.validation: real files in tmp_path, no mocks."""

from __future__ import annotations

import csv
import json
import math

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.datasets.validation import (
    FILE_TYPES,
    FORMATS,
    MAX_LISTED,
    DatasetFormatError,
    DatasetTooLargeError,
    ValidationReport,
    detect_file_type,
    iter_conversations,
    validate_file,
)

# ---------------------------------------------------------------------------------------------
# helpers


def chat(i: int, system: bool = True) -> dict:
    msgs = [{"role": "system", "content": "You are terse."}] if system else []
    msgs += [
        {"role": "user", "content": f"question number {i}?"},
        {"role": "assistant", "content": f"answer number {i}."},
    ]
    return {"messages": msgs}


def record(fmt: str, i: int) -> dict:
    if fmt == "chat":
        return chat(i)
    if fmt == "prompt_completion":
        return {"prompt": f"prompt {i}", "completion": f"completion {i}"}
    if fmt == "alpaca":
        return {"instruction": f"instruction {i}", "input": f"input {i}" if i % 2 else "", "output": f"output {i}"}
    if fmt == "preference":  # TRL's standard form
        return {"prompt": f"prompt {i}", "chosen": f"good answer {i}", "rejected": f"bad answer {i}"}
    return {"text": f"some text number {i}"}


def write_jsonl(path, items, *, newline_at_end: bool = True) -> str:
    """items: dicts (dumped) or str (written verbatim, e.g. bad JSON or blank lines)."""
    lines = [x if isinstance(x, str) else json.dumps(x) for x in items]
    path.write_text("\n".join(lines) + ("\n" if newline_at_end else ""), encoding="utf-8")
    return str(path)


def lines_of(errors):
    return [e["line"] for e in errors]


# ---------------------------------------------------------------------------------------------
# API surface


def test_constants():
    assert FILE_TYPES == ("jsonl", "csv", "parquet")
    assert FORMATS == ("chat", "prompt_completion", "alpaca", "text", "preference")
    assert MAX_LISTED == 100
    assert issubclass(DatasetFormatError, ValueError)


@pytest.mark.parametrize(
    "name,head,expected",
    [
        ("a.jsonl", b"", "jsonl"),
        ("a.JSON", b"", "jsonl"),
        ("a.ndjson", b"", "jsonl"),
        ("a.csv", b"{", "csv"),
        ("a.parquet", b"", "parquet"),
        ("a.pq", b"", "parquet"),
        ("upload", b"PAR1\x15\x04", "parquet"),
        ("upload.txt", b'\n  \n {"text": "x"}\n', "jsonl"),
        ("upload.txt", b'\xef\xbb\xbf{"text": "x"}\n', "jsonl"),
        ("upload", b"prompt,completion\nhi,there\n", "csv"),
        ("upload", b"", "csv"),
    ],
)
def test_detect_file_type(name, head, expected):
    assert detect_file_type(name, head) == expected


def test_detect_file_type_binary_raises():
    with pytest.raises(DatasetFormatError, match="blob.bin"):
        detect_file_type("blob.bin", b"\x89PNG\r\n\x1a\n\x00\x00")


# ---------------------------------------------------------------------------------------------
# formats in JSONL, CSV, Parquet


@pytest.mark.parametrize("fmt", FORMATS)
def test_jsonl_each_format_detected_and_counted(tmp_path, fmt):
    path = write_jsonl(tmp_path / "d.jsonl", [record(fmt, i) for i in range(30)])
    report = validate_file(path, "d.jsonl")
    assert isinstance(report, ValidationReport)
    assert (report.file_type, report.format) == ("jsonl", fmt)
    assert report.rows == report.valid_rows == 30
    assert report.errors == [] and report.error_count == 0
    assert report.ok
    assert len(report.preview) == 20
    json.dumps(report.to_dict())  # plain JSON-able data
    assert report.to_dict()["ok"] is True


def test_normalisation_in_preview(tmp_path):
    path = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"instruction": "Translate", "input": "bonjour", "output": "hello"},
            {"instruction": "Say hi", "output": "hi"},
        ],
    )
    report = validate_file(path, "a.jsonl")
    assert report.format == "alpaca"
    assert report.preview[0] == {
        "line": 1,
        "messages": [{"role": "user", "content": "Translate\n\nbonjour"}, {"role": "assistant", "content": "hello"}],
    }
    assert report.preview[1]["messages"][0] == {"role": "user", "content": "Say hi"}

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2", "completion": "4"}])
    assert validate_file(path, "p.jsonl").preview == [
        {"line": 1, "messages": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]}
    ]
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}])
    report = validate_file(path, "t.jsonl")
    assert report.preview == [{"line": 1, "messages": [{"role": "text", "content": "hello world"}]}]
    assert report.stats["roles"]["text"] == 1


def _columns(fmt: str, n: int) -> dict[str, list]:
    recs = [record(fmt, i) for i in range(n)]
    if fmt == "chat":
        return {"messages": [json.dumps(r["messages"]) for r in recs]}
    return {k: [r[k] for r in recs] for k in recs[0]}


@pytest.mark.parametrize("fmt", FORMATS)
def test_csv_each_format(tmp_path, fmt):
    cols = _columns(fmt, 25)
    path = tmp_path / "d.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(list(cols) + ["extra"])
        for row in zip(*cols.values(), strict=True):
            w.writerow(list(row) + ["ignored"])
    report = validate_file(path, "d.csv")
    assert (report.file_type, report.format) == ("csv", fmt)
    assert report.rows == report.valid_rows == 25, report.errors
    assert report.ok
    assert report.preview[0]["line"] == 2  # header is line 1
    jsonl = validate_file(write_jsonl(tmp_path / "d.jsonl", [record(fmt, i) for i in range(25)]), "d.jsonl")
    assert report.stats == jsonl.stats
    assert report.preview == [{**p, "line": p["line"] + 1} for p in jsonl.preview]


@pytest.mark.parametrize("fmt", FORMATS)
def test_parquet_each_format(tmp_path, fmt):
    path = tmp_path / "d.parquet"
    if fmt == "chat":
        table = pa.table({"messages": [record(fmt, i)["messages"] for i in range(25)]})  # list<struct>
        assert pa.types.is_list(table.schema.field("messages").type)
    else:
        table = pa.table(_columns(fmt, 25))
    pq.write_table(table, path)
    report = validate_file(path, "d.parquet")
    assert (report.file_type, report.format) == ("parquet", fmt)
    assert report.rows == report.valid_rows == 25, report.errors
    assert report.ok
    jsonl = validate_file(write_jsonl(tmp_path / "d.jsonl", [record(fmt, i) for i in range(25)]), "d.jsonl")
    assert report.stats == jsonl.stats
    assert report.preview == jsonl.preview  # parquet "line" is the 1-based row number


def test_parquet_chat_json_string_column_and_row_errors(tmp_path):
    msgs = [json.dumps(chat(i)["messages"]) for i in range(5)]
    msgs[2] = "[not json"
    msgs[3] = json.dumps([{"role": "assistant", "content": "hi"}])
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"messages": msgs, "id": list(range(5))}), path, row_group_size=2)
    report = validate_file(path, "whatever.bin")  # type sniffed from the PAR1 magic
    assert report.file_type == "parquet" and report.format == "chat"
    assert report.rows == 5 and report.valid_rows == 3
    assert lines_of(report.errors) == [3, 4]
    assert report.errors[0]["field"] == "messages" and report.errors[0]["message"].startswith("invalid JSON")
    assert report.errors[1]["field"] == "messages[0].role"


def test_parquet_nulls_and_missing_columns(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", None, "c"], "completion": ["x", "y", ""]}), path)
    report = validate_file(path, "d.parquet")
    assert [(e["line"], e["field"]) for e in report.errors] == [(2, "prompt"), (3, "completion")]
    assert report.errors[0]["message"] == "missing required field 'prompt'"
    assert report.errors[1]["message"] == "empty completion"

    report = validate_file(path, "d.parquet", fmt="alpaca")
    assert report.rows == 0 and not report.ok
    assert report.error_count == 1 and "instruction, output" in report.errors[0]["message"]


def test_csv_missing_columns_is_one_error_on_line_1(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt,answer\nhi,there\n", encoding="utf-8")
    report = validate_file(path, "d.csv", fmt="prompt_completion")
    assert (
        report.errors == [{"line": 1, "field": None, "message": report.errors[0]["message"]}]
        and "completion" in report.errors[0]["message"]
    )
    assert report.error_count == 1 and not report.ok


def test_csv_multiline_quoted_fields_line_numbers(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text(
        "prompt,completion\r\n"  # line 1
        'one,"two\r\nlines"\r\n'  # lines 2-3
        "\r\n"  # 4 (blank: skipped)
        '"a\nb\nc",""\r\n'  # lines 5-7 (empty completion)
        "ok,fine\r\n"  # line 8
        ',"x"\r\n',  # line 9 (empty prompt)
        encoding="utf-8",
    )
    report = validate_file(path, "d.csv")
    assert report.format == "prompt_completion"
    assert report.rows == 4 and report.valid_rows == 2
    assert [(e["line"], e["field"]) for e in report.errors] == [(5, "completion"), (9, "prompt")]
    assert [p["line"] for p in report.preview] == [2, 5, 8, 9]
    assert report.preview[0]["messages"][1]["content"] == "two\r\nlines"


def test_csv_chat_messages_json_cells_and_duplicates(tmp_path):
    path = tmp_path / "d.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["messages"])
        w.writerow([json.dumps(chat(1)["messages"])])  # line 2
        w.writerow(["{oops"])  # line 3
        w.writerow([""])  # line 4: an empty cell; csv writes '""'
        w.writerow([json.dumps(chat(1)["messages"], indent=1)])  # lines 5-.. same content, other formatting
    report = validate_file(path, "d.csv")
    assert report.format == "chat"
    assert [(e["line"], e["field"]) for e in report.errors] == [(3, "messages"), (4, "messages")]
    assert report.duplicates == [{"line": 5, "duplicate_of": 2}]


# ---------------------------------------------------------------------------------------------
# overrides and undeterminable inputs


def test_overrides(tmp_path):
    # a .txt name with JSONL content: sniffed, or forced
    path = write_jsonl(tmp_path / "d.txt", [{"text": "a", "prompt": "p", "completion": "c"}] * 3)
    auto = validate_file(path, "d.txt")
    assert (auto.file_type, auto.format) == ("jsonl", "prompt_completion")
    forced = validate_file(path, "d.txt", file_type="jsonl", fmt="text")
    assert (forced.file_type, forced.format) == ("jsonl", "text") and forced.valid_rows == 3

    # forcing a format the records don't have: per-record errors, not an exception
    path = write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(3)])
    report = validate_file(path, "c.jsonl", fmt="prompt_completion")
    assert report.format == "prompt_completion" and report.valid_rows == 0
    assert [(e["line"], e["field"]) for e in report.errors] == [(1, "prompt"), (2, "prompt"), (3, "prompt")]

    # forcing a file type: a JSONL file read as CSV has no usable header
    with pytest.raises(DatasetFormatError, match="c.jsonl"):
        validate_file(path, "c.jsonl", file_type="csv")
    with pytest.raises(DatasetFormatError, match="Parquet"):
        validate_file(path, "c.jsonl", file_type="parquet")


def test_unknown_override_values_raise(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(1)])
    with pytest.raises(DatasetFormatError) as exc:
        validate_file(path, "d.jsonl", file_type="xlsx")
    assert "xlsx" in str(exc.value) and "jsonl, csv, parquet" in str(exc.value)
    with pytest.raises(DatasetFormatError) as exc:
        validate_file(path, "d.jsonl", fmt="sharegpt")
    assert "sharegpt" in str(exc.value) and "chat, prompt_completion, alpaca, text" in str(exc.value)


def test_undetectable_format_names_keys(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["not json", {"question": "q", "answer": "a"}, chat(1)])
    with pytest.raises(DatasetFormatError) as exc:
        validate_file(path, "d.jsonl")
    msg = str(exc.value)
    assert "d.jsonl" in msg and "'answer', 'question'" in msg and "messages" in msg and "prompt" in msg

    path = write_jsonl(tmp_path / "arr.json", ["[", json.dumps(chat(1)) + ",", "]"])
    with pytest.raises(DatasetFormatError, match="JSON array"):
        validate_file(path, "arr.json")


@pytest.mark.parametrize("name,content", [("e.jsonl", ""), ("e.jsonl", "\n\n  \n"), ("e.csv", "prompt,completion\n")])
def test_empty_file_is_an_error(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    report = validate_file(path, name)
    assert report.rows == 0 and not report.ok
    assert report.errors == [{"line": 0, "field": None, "message": "the file has no records"}]
    assert report.error_count == 1
    assert report.stats == {} and report.duplicates == [] and report.preview == []
    json.dumps(report.to_dict())


# ---------------------------------------------------------------------------------------------
# record checks


def test_acceptance_bad_json_missing_messages_system_after_user(tmp_path):
    items: list = [chat(i) for i in range(1, 21)]
    items[6] = '{"messages": [{"role": "user", "content": "hi"'  # line 7: bad JSON
    items[11] = {"prompt": "no messages here", "completion": "x"}  # line 12: no messages
    items[14] = {  # line 15: system turn after a user turn
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "late system prompt"},
            {"role": "assistant", "content": "hello"},
        ]
    }
    path = write_jsonl(tmp_path / "chat.jsonl", items)
    report = validate_file(path, "chat.jsonl")
    assert report.format == "chat"
    assert lines_of(report.errors) == [7, 12, 15]
    assert [e["field"] for e in report.errors] == [None, "messages", "messages[1].role"]
    assert report.errors[0]["message"].startswith("invalid JSON: ")
    assert report.errors[1]["message"] == "missing required field 'messages'"
    assert report.errors[2]["message"] == "'system' turn must come first; found after a 'user' turn"
    assert report.rows == 20 and report.valid_rows == 17 and report.error_count == 3
    assert not report.ok
    # invalid records show up in the preview with their error
    by_line = {p["line"]: p for p in report.preview}
    assert by_line[7]["error"].startswith("invalid JSON")
    assert by_line[15]["error"].startswith("messages[1].role: ")
    assert "messages" in by_line[8]


CHAT_CASES = [
    ({"messages": "hi"}, "messages", "wrong type: expected list, got string"),
    ({"messages": []}, "messages", "must be a non-empty list of messages"),
    ({"messages": ["hi"]}, "messages[0]", "wrong type: expected object, got string"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "missing required field 'role'"),
    ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role", "wrong type: expected string, got int"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "invalid role 'tool'"),
    (
        {"messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "x"}]},
        "messages[0].content",
        "wrong type: expected string, got int",
    ),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
        "messages[1].content",
        "wrong type: expected string, got null",
    ),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
        "messages[1].content",
        "empty content",
    ),
    (
        {"messages": [{"role": "user", "content": " \n\t"}, {"role": "assistant", "content": "a"}]},
        "messages[0].content",
        "empty content",
    ),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]},
        "messages[1].content",
        "missing required field 'content'",
    ),
    (
        {"messages": [{"role": "assistant", "content": "a"}]},
        "messages[0].role",
        "the first turn must be 'user', got 'assistant'",
    ),
    (
        {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
        "messages[1].role",
        "the first turn after 'system' must be 'user', got 'assistant'",
    ),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q2"}]},
        "messages[1].role",
        "expected 'assistant' after 'user', got 'user'",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "assistant", "content": "a2"},
            ]
        },
        "messages[2].role",
        "expected 'user' after 'assistant', got 'assistant'",
    ),
    (
        {"messages": [{"role": "system", "content": "s"}, {"role": "system", "content": "s"}]},
        "messages[1].role",
        "only one 'system' turn is allowed",
    ),
    ({"messages": [{"role": "system", "content": "s"}]}, "messages", "there must be at least one 'assistant' turn"),
    (
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "user", "content": "q2"},
            ]
        },
        "messages[2].role",
        "the last turn must be 'assistant' (it is the training target)",
    ),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 2}]},
        "messages[1].weight",
        "weight must be 0 or 1",
    ),
    ([1, 2], None, "expected a JSON object, got list"),
]


@pytest.mark.parametrize("bad,field,message", CHAT_CASES)
def test_chat_record_errors(tmp_path, bad, field, message):
    # the bad record sits both inside the preview window (slow path) and after it (fast path)
    items = [chat(i) for i in range(30)]
    items[3] = bad
    items[25] = bad
    path = write_jsonl(tmp_path / "c.jsonl", items)
    report = validate_file(path, "c.jsonl", fmt="chat")
    assert lines_of(report.errors) == [4, 26]
    for err in report.errors:
        assert err["field"] == field
        assert err["message"].startswith(message), err["message"]
    assert report.valid_rows == 28 and report.rows == 30


@pytest.mark.parametrize(
    "good",
    [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 1}]},
        {"messages": [{"role": "user", "content": "q", "name": "bob"}, {"role": "assistant", "content": "a"}]},
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "user", "content": "q2"},
                {"role": "assistant", "content": "a2"},
            ],
            "id": 7,
        },
    ],
)
def test_chat_valid_variants(tmp_path, good):
    items = [chat(i) for i in range(30)]
    items[3] = good
    items[25] = good
    report = validate_file(write_jsonl(tmp_path / "c.jsonl", items), "c.jsonl")
    assert report.ok and report.valid_rows == 30, report.errors
    assert report.duplicates == [{"line": 26, "duplicate_of": 4}]


@pytest.mark.parametrize(
    "fmt,bad,field,message",
    [
        ("prompt_completion", {"prompt": "p"}, "completion", "missing required field 'completion'"),
        ("prompt_completion", {"prompt": 3, "completion": "c"}, "prompt", "wrong type: expected string, got int"),
        ("prompt_completion", {"prompt": "", "completion": "c"}, "prompt", "empty prompt"),
        ("prompt_completion", {"prompt": "p", "completion": "  "}, "completion", "empty completion"),
        ("alpaca", {"instruction": "i"}, "output", "missing required field 'output'"),
        ("alpaca", {"instruction": "i", "input": 5, "output": "o"}, "input", "wrong type: expected string, got int"),
        ("alpaca", {"instruction": "", "output": "o"}, "instruction", "empty instruction"),
        ("text", {"text": ["a"]}, "text", "wrong type: expected string, got list"),
        ("text", {"text": "\n"}, "text", "empty text"),
        ("text", "3", None, "expected a JSON object, got int"),
        ("preference", {"prompt": "p", "chosen": "c"}, "rejected", "missing required field 'rejected'"),
        ("preference", {"prompt": "p", "chosen": " ", "rejected": "r"}, "chosen", "empty chosen"),
        (
            "preference",
            {"prompt": 4, "chosen": "c", "rejected": "r"},
            "prompt",
            "wrong type: expected string or list of messages, got int",
        ),
        (
            "preference",
            {
                "prompt": [{"role": "user", "content": "q"}],
                "chosen": [{"role": "user", "content": "c"}],
                "rejected": "r",
            },
            "chosen[0].role",
            "must be 'assistant', got 'user'",
        ),
        (
            "preference",
            {"prompt": [{"role": "user", "content": "q"}], "chosen": "c", "rejected": [{"role": "assistant"}]},
            "rejected[0].content",
            "missing required field 'content'",
        ),
        (
            "preference",
            {"prompt": [{"role": "user", "content": "q"}], "chosen": "c", "rejected": ["r"]},
            "rejected",
            "expected a string or a list of one assistant message, got list",
        ),
        (
            "preference",
            {
                "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "chosen": "c",
                "rejected": "r",
            },
            "prompt[1].role",
            "the last turn must be 'user' (the answers reply to it)",
        ),
        (
            "preference",
            {
                "prompt": [
                    {"role": "user", "content": "q"},
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "q"},
                ],
                "chosen": "c",
                "rejected": "r",
            },
            "prompt[1].role",
            "'system' turn must come first; found after a 'user' turn",
        ),
    ],
)
def test_other_format_record_errors(tmp_path, fmt, bad, field, message):
    items = [record(fmt, i) for i in range(30)]
    items[2] = bad
    items[27] = bad
    report = validate_file(write_jsonl(tmp_path / "d.jsonl", items), "d.jsonl", fmt=fmt)
    assert [(e["line"], e["field"], e["message"]) for e in report.errors] == [(3, field, message), (28, field, message)]


def test_preference_conversational_form_normalised(tmp_path):
    """TRL's conversational preference form: a chat prompt, each answer one assistant message."""
    system = {"role": "system", "content": "Be brief."}
    convo = {
        "prompt": [system, {"role": "user", "content": "Capital of Chad?"}],
        "chosen": [{"role": "assistant", "content": "N'Djamena."}],
        "rejected": [{"role": "assistant", "content": "Paris."}],
    }
    path = write_jsonl(tmp_path / "d.jsonl", [convo, record("preference", 1)])
    report = validate_file(path, "d.jsonl")
    assert (report.format, report.valid_rows, report.errors) == ("preference", 2, [])
    assert [list(iter_conversations(path, "d.jsonl", file_type=None, fmt=None))] == [
        [
            [
                system,
                {"role": "user", "content": "Capital of Chad?"},
                {"role": "assistant", "content": "N'Djamena."},
                {"role": "rejected", "content": "Paris."},
            ],
            [
                {"role": "user", "content": "prompt 1"},
                {"role": "assistant", "content": "good answer 1"},
                {"role": "rejected", "content": "bad answer 1"},
            ],
        ]
    ]


def test_alpaca_input_optional(tmp_path):
    items = [
        {"instruction": "i", "output": "o"},
        {"instruction": "i", "input": None, "output": "o"},
        {"instruction": "i", "input": "", "output": "o"},
        {"instruction": "i", "input": "x", "output": "o"},
    ]
    report = validate_file(write_jsonl(tmp_path / "a.jsonl", items * 8), "a.jsonl")
    assert report.ok and report.valid_rows == 32
    assert report.stats["chars"]["min"] == 2 and report.stats["chars"]["max"] == 5  # "i\n\nx" + "o"


# ---------------------------------------------------------------------------------------------
# line numbers, duplicates, caps, stats, preview, progress


def test_blank_lines_skipped_but_counted_for_numbering(tmp_path):
    items = ["", chat(1), "   ", "", chat(2), "{bad", "", chat(3)]
    path = tmp_path / "b.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in items) + "\r\n", encoding="utf-8")
    report = validate_file(path, "b.jsonl")
    assert report.rows == 4 and report.valid_rows == 3
    assert lines_of(report.errors) == [6]
    assert [p["line"] for p in report.preview] == [2, 5, 6, 8]


def test_duplicates_reported_with_first_occurrence(tmp_path):
    items = [chat(i) for i in range(10)]
    items[4] = chat(1)  # line 5 duplicates line 2
    items[7] = chat(1)  # line 8 duplicates line 2
    items[9] = chat(6)  # line 10 duplicates line 7
    path = write_jsonl(tmp_path / "d.jsonl", items, newline_at_end=False)  # last line has no newline
    report = validate_file(path, "d.jsonl")
    assert report.duplicates == [
        {"line": 5, "duplicate_of": 2},
        {"line": 8, "duplicate_of": 2},
        {"line": 10, "duplicate_of": 7},
    ]
    assert report.duplicate_count == 3
    assert report.ok  # duplicates are reported, not errors


def test_large_file_fast_path_lines_duplicates_and_caps(tmp_path):
    """Several read batches: errors, blank lines and duplicates far past the preview window."""
    n = 6000
    items: list = []
    expected_errors = []
    first_seen: dict[str, int] = {}
    expected_dups = []
    for i in range(n):
        line = i + 1
        if i % 97 == 50:
            items.append("")  # blank
            continue
        if i % 41 == 40:
            items.append('{"messages": [}')
            expected_errors.append(line)
            continue
        if i % 53 == 52:
            items.append(json.dumps({"messages": [{"role": "user", "content": "q"}]}))
            expected_errors.append(line)
            continue
        rec = chat(i % 1500 if i % 7 == 0 else i, system=i % 2 == 0)
        if i % 211 == 0:
            rec["messages"][-1]["weight"] = 1  # valid via the slow path
        s = json.dumps(rec)
        if s in first_seen:
            expected_dups.append({"line": line, "duplicate_of": first_seen[s]})
        else:
            first_seen[s] = line
        items.append(s)
    path = write_jsonl(tmp_path / "big.jsonl", items)
    assert (tmp_path / "big.jsonl").stat().st_size > 4 * 65536
    report = validate_file(path, "big.jsonl")
    assert report.error_count == len(expected_errors) > MAX_LISTED
    assert lines_of(report.errors) == expected_errors[:MAX_LISTED]
    assert report.rows == n - sum(1 for i in range(n) if i % 97 == 50)
    assert report.valid_rows == report.rows - len(expected_errors)
    assert report.duplicate_count == len(expected_dups) > 0
    assert report.duplicates == expected_dups[:MAX_LISTED]


def test_errors_capped_at_max_listed(tmp_path):
    items = ["{nope"] * 250 + [chat(1)]
    report = validate_file(write_jsonl(tmp_path / "e.jsonl", items), "e.jsonl", fmt="chat")
    assert report.error_count == 250
    assert len(report.errors) == MAX_LISTED
    assert lines_of(report.errors) == list(range(1, MAX_LISTED + 1))
    assert report.rows == 251 and report.valid_rows == 1


def test_stats_and_histogram(tmp_path):
    items = []
    for i in range(200):
        items.append(
            {
                "messages": [
                    {"role": "user", "content": "q" * (1 + i)},
                    {"role": "assistant", "content": "a" * (1 + 3 * i)},
                ]
            }
        )
    items.append({"messages": [{"role": "system", "content": "s"}] + items[0]["messages"]})
    items.append("{bad")
    report = validate_file(write_jsonl(tmp_path / "s.jsonl", items), "s.jsonl")
    st = report.stats
    assert report.valid_rows == 201
    for key in ("chars", "tokens"):
        s = st[key]
        assert s["min"] <= s["median"] <= s["p95"] <= s["max"]
        assert s["min"] <= s["mean"] <= s["max"]
    assert st["chars"]["min"] == 2 and st["chars"]["max"] == 200 + 598
    # tokens = ceil(chars / 4) + 4 per message
    assert st["tokens"]["min"] == 1 + 8
    assert st["tokens"]["max"] == math.ceil(798 / 4) + 8
    chars_total = sum(len(m["content"]) for it in items[:-1] for m in it["messages"])
    expected_total = sum(
        math.ceil(sum(len(m["content"]) for m in it["messages"]) / 4) + 4 * len(it["messages"]) for it in items[:-1]
    )
    assert st["tokens_total"] == expected_total and chars_total > 0
    assert st["token_estimate"] == "chars/4"
    assert st["roles"] == {"system": 1, "user": 201, "assistant": 201}
    h = st["histogram"]
    assert h["unit"] == "tokens"
    assert 1 < len(h["counts"]) <= 30 and len(h["edges"]) == len(h["counts"]) + 1
    assert sum(h["counts"]) == report.valid_rows
    assert h["edges"][0] == st["tokens"]["min"] and h["edges"][-1] > st["tokens"]["max"]
    widths = {b - a for a, b in zip(h["edges"], h["edges"][1:], strict=False)}
    assert len(widths) == 1  # equal width


def test_histogram_single_bin_when_all_equal(tmp_path):
    report = validate_file(write_jsonl(tmp_path / "t.jsonl", [{"text": "abcd"}] * 5), "t.jsonl")
    h = report.stats["histogram"]
    assert h["counts"] == [5] and len(h["edges"]) == 2
    assert report.stats["tokens"] == {"min": 5, "median": 5.0, "p95": 5.0, "max": 5, "mean": 5.0}
    assert report.duplicate_count == 4


def test_preview_first_20_records_and_truncation(tmp_path):
    items = [chat(i) for i in range(50)]
    items[0] = {"messages": [{"role": "user", "content": "x" * 5000}, {"role": "assistant", "content": "ok"}]}
    items[3] = {"messages": 1}
    report = validate_file(write_jsonl(tmp_path / "p.jsonl", items), "p.jsonl")
    assert [p["line"] for p in report.preview] == list(range(1, 21))
    assert len(report.preview[0]["messages"][0]["content"]) == 2000
    assert report.preview[3] == {"line": 4, "error": "messages: wrong type: expected list, got int"}
    assert report.preview[1]["messages"] == chat(1)["messages"]


def test_progress_callback(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(2000)])
    calls = []
    validate_file(path, "p.jsonl", progress=lambda done, total: calls.append((done, total)))
    size = (tmp_path / "p.jsonl").stat().st_size
    assert calls and calls[-1] == (size, size)
    assert all(0 <= d <= t == size for d, t in calls)
    assert len(calls) <= 2  # throttled: a fast run reports (almost) only the end

    csv_path = tmp_path / "p.csv"
    csv_path.write_text("text\nhello\n", encoding="utf-8")
    calls.clear()
    validate_file(csv_path, "p.csv", progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (csv_path.stat().st_size,) * 2


def test_bom_and_crlf(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + orjson.dumps(chat(1)) + b"\r\n" + orjson.dumps(chat(2)) + b"\r\n")
    report = validate_file(path, "bom.jsonl")
    assert report.ok and report.valid_rows == 2

    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbfprompt,completion\r\nhi,there\r\n")
    report = validate_file(path, "bom.csv")
    assert report.ok and report.format == "prompt_completion"


def _fuzz_records(rng, fmt: str, n: int) -> list:
    values = ["hi", "", "  ", "\n", 0, 1, 2, None, True, [], ["x"], {}, {"a": 1}, 1.5, "ok ok"]
    out = []
    for _ in range(n):
        if fmt == "chat":
            roles = rng.choice(
                [["user", "assistant"], ["system", "user", "assistant"], ["user", "assistant"] * 2, ["system"]]
            )
            roles = list(roles)
            if rng.random() < 0.3:
                i = rng.randrange(len(roles))
                roles[i] = rng.choice(["user", "assistant", "system", "tool", 3, None])
            msgs = [{"role": r, "content": f"c{rng.random()}"} for r in roles]
            for m in msgs:
                if rng.random() < 0.1:
                    m["content"] = rng.choice(values)
                if rng.random() < 0.05:
                    del m[rng.choice(["role", "content"])]
                if rng.random() < 0.08:
                    m["weight"] = rng.choice([0, 1, 2, True, None, 1.0])
                if rng.random() < 0.05:
                    m["name"] = "n"
            rec = {"messages": msgs}
            if rng.random() < 0.05:
                rec["messages"] = rng.choice(values + [[rng.choice(values)]])
            if rng.random() < 0.03:
                rec = {"msgs": msgs}
        else:
            rec = record(fmt, rng.randrange(1000))
            for k in list(rec):
                if rng.random() < 0.12:
                    rec[k] = rng.choice(values)
                if rng.random() < 0.05:
                    del rec[k]
        if rng.random() < 0.02:
            rec = rng.choice(values)
        out.append(json.dumps(rec))  # a JSON line (write_jsonl writes str items verbatim)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_fast_path_agrees_with_slow_path(tmp_path, fmt):
    """Records past the preview window take the fast path; each must be judged exactly like the
    same record at the top of a file (which always takes the slow, authoritative path)."""
    import random

    rng = random.Random(1234 + FORMATS.index(fmt))
    fuzz = _fuzz_records(rng, fmt, 300)
    fillers = [record(fmt, -i - 1) for i in range(20)]
    for start in range(0, len(fuzz), 60):  # < MAX_LISTED records per file, so every error is listed
        part = fuzz[start : start + 60]
        big = validate_file(write_jsonl(tmp_path / "big.jsonl", fillers + part), "big.jsonl", fmt=fmt)
        got = {e["line"]: (e["field"], e["message"]) for e in big.errors}
        assert big.error_count == len(got)
        n_valid = 20
        for i, rec in enumerate(part):
            one = validate_file(write_jsonl(tmp_path / "one.jsonl", [rec]), "one.jsonl", fmt=fmt)
            want = (one.errors[0]["field"], one.errors[0]["message"]) if one.error_count else None
            assert got.get(21 + i) == want, rec
            n_valid += one.valid_rows
        assert big.valid_rows == n_valid and big.rows == 20 + len(part)


def test_csv_invalid_utf8_and_old_mac_line_endings(tmp_path):
    path = tmp_path / "u.csv"
    path.write_bytes(b'prompt,completion\nhi,there\nbad\xff,x\nok,y\n"multi\nli\xffne",z\nfine,w')
    report = validate_file(path, "u.csv")
    assert report.rows == 5 and report.valid_rows == 3
    assert [(e["line"], e["message"]) for e in report.errors] == [
        (3, "not valid UTF-8 text"),
        (5, "not valid UTF-8 text (at line 6)"),
    ]
    assert report.preview[-1]["line"] == 7

    path = tmp_path / "mac.csv"
    path.write_bytes(b'prompt,completion\rhi,there\r"a\rb",c\rok,y')
    report = validate_file(path, "mac.csv")
    assert report.ok and report.rows == 3
    assert [p["line"] for p in report.preview] == [2, 3, 5]
    assert report.preview[1]["messages"][0]["content"] == "a\rb"


def test_overlong_lines_are_reported_not_held(tmp_path):
    from app.datasets import validation

    big = "x" * (validation._MAX_LINE + 10)
    items: list = [chat(i) for i in range(30)]
    items[2] = json.dumps({"text": big})  # inside the preview window
    items[25] = json.dumps(chat(25))[:-1] + big  # past it: garbage, no closing brace
    path = write_jsonl(tmp_path / "long.jsonl", items + [chat(1)])
    report = validate_file(path, "long.jsonl")
    assert [(e["line"], e["message"]) for e in report.errors] == [
        (3, "record too long: more than 16 MiB on one line"),
        (26, "record too long: more than 16 MiB on one line"),
    ]
    assert report.rows == 31 and report.valid_rows == 29
    assert report.duplicates == [{"line": 31, "duplicate_of": 2}]

    csv_path = tmp_path / "long.csv"
    csv_path.write_text("text\nshort\n" + big + "\nafter\n", encoding="utf-8")
    report = validate_file(csv_path, "long.csv")
    assert report.valid_rows == 1 and report.error_count == 1
    assert report.errors[0]["line"] == 3 and "longer than 16 MiB" in report.errors[0]["message"]


def test_csv_record_of_many_long_fields_is_not_held(tmp_path):
    """Each line is short and each field under the 64 MiB field limit, but the record on line 3 holds
    three fields of 30 MiB: reading stops there, as at an overlong line, instead of holding it whole."""
    field = b'"' + (b"y" * ((1 << 20) - 1) + b"\n") * 30 + b'"'
    path = tmp_path / "wide.csv"
    path.write_bytes(b"text,a,b\nshort,1,2\n" + b",".join([field] * 3) + b"\nafter,3,4\n")
    report = validate_file(path, "wide.csv")
    assert report.errors == [
        {"line": 3, "field": None, "message": "the record on line 3 is longer than 64 MiB; stopped reading here"}
    ]
    assert report.rows == report.valid_rows == 1


# ---------------------------------------------------------------------------------------------
# Parquet files that decode to far more than they weigh


def _repeated(value: str, rows: int) -> pa.DictionaryArray:
    """``rows`` rows that all point to one dictionary entry: a few bytes of run-length encoded indices."""
    return pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array([value]))


def _too_large(path, name: str, max_bytes: int) -> str:
    with pytest.raises(DatasetTooLargeError) as exc:
        validate_file(path, name, max_bytes=max_bytes)
    return str(exc.value)


def test_parquet_bombs_are_refused_before_they_are_decoded(tmp_path):
    mib = 1 << 20
    # One 1 MiB dictionary entry, 16384 rows: 16 GiB of text from a file of a few hundred bytes, with and
    # without the Arrow schema that makes pyarrow keep the column as a dictionary.
    for store_schema in (True, False):
        path = tmp_path / f"bomb-{store_schema}.parquet"
        pq.write_table(
            pa.table({"text": _repeated("a" * mib, 1 << 14)}), path, store_schema=store_schema, compression="zstd"
        )
        assert path.stat().st_size < 2048
        assert _too_large(path, "bomb.parquet", 10 << 30) == (
            "bomb.parquet: too large once decoded: by row group 0, column 'text' the records come to 16.0 GiB, "
            "more than the 10.0 GiB a dataset may hold (TUNEDECK_MAX_UPLOAD_BYTES); "
            f"the file itself is {path.stat().st_size} bytes"
        )

    # The bomb in the third row group, after two that are fine: that one is named.
    path = tmp_path / "third.parquet"
    schema = pa.schema([("prompt", pa.string()), ("completion", pa.dictionary(pa.int32(), pa.string()))])
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        for i in range(2):
            writer.write_table(pa.table({"prompt": ["p"] * 10, "completion": _repeated(f"c{i}", 10)}, schema=schema))
        writer.write_table(pa.table({"prompt": ["p"] * 4096, "completion": _repeated("c" * mib, 4096)}, schema=schema))
    assert "by row group 2, column 'completion' the records come to 4.0 GiB" in _too_large(path, "t.parquet", 1 << 30)

    # Each value repeating the one before (DELTA_BYTE_ARRAY), and long chat messages, a list per row.
    path = tmp_path / "delta.parquet"
    table = pa.table({"text": ["b" * mib] * 64})
    pq.write_table(table, path, use_dictionary=False, column_encoding={"text": "DELTA_BYTE_ARRAY"}, compression="zstd")
    assert path.stat().st_size < 4096
    assert "row group 0, column 'text'" in _too_large(path, "delta.parquet", 16 * mib)
    path = tmp_path / "chat.parquet"
    rows = 4096
    content = pa.DictionaryArray.from_arrays(pa.array([0, 1] * rows, pa.int32()), pa.array(["q" * mib, "a"]))
    turns = pa.StructArray.from_arrays([pa.array(["user", "assistant"] * rows), content], ["role", "content"])
    messages = pa.ListArray.from_arrays(pa.array(range(0, 2 * rows + 1, 2), pa.int32()), turns)
    pq.write_table(pa.table({"messages": messages}), path, compression="zstd")
    assert path.stat().st_size < 4096
    assert "by row group 0, column 'messages' the records come to 4.0 GiB" in _too_large(path, "c.parquet", 1 << 30)


def test_parquet_values_that_repeat_but_fit_are_counted_not_refused(tmp_path):
    """A dictionary with one long entry, used once, among short ones: that entry bounds each row at 4 MiB,
    too much for the limit; the count finds the file holds about 5 MiB, and it is fine. Once with every
    value in the dictionary, once with a dictionary the writer gave up on (it grew past its page limit):
    the later values are stored as they are, and the count reads them decoded."""
    for rows, page_limit in ((1000, 1 << 30), (70_000, None)):
        texts = [f"text number {i}" for i in range(rows)]
        texts[3] = "L" * (4 << 20)
        path = tmp_path / f"outlier-{rows}.parquet"
        pq.write_table(pa.table({"text": texts}), path, dictionary_pagesize_limit=page_limit)
        report = validate_file(path, "o.parquet", max_bytes=16 << 20)
        assert report.ok and report.rows == report.valid_rows == rows, report.errors
        assert report.stats["chars"]["max"] == 4 << 20


def test_parquet_records_are_made_a_slice_at_a_time(tmp_path):
    """200 rows of a 1 MiB dictionary entry (200 MiB once decoded) never sit in Python memory all at once,
    and a record over 16 MiB is reported, naming its column, without being made."""
    import tracemalloc

    path = tmp_path / "wide.parquet"
    rows = 200
    entries = pa.array(["p" * (1 << 20), "x" * (20 << 20)])
    prompts = pa.DictionaryArray.from_arrays(pa.array([0] * 99 + [1] + [0] * 100, pa.int32()), entries)
    table = pa.table({"prompt": prompts, "completion": [f"c{i}" for i in range(rows)]})
    pq.write_table(table, path, compression="zstd")
    tracemalloc.start()
    try:
        report = validate_file(path, "wide.parquet")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.rows == rows and report.valid_rows == rows - 1
    assert report.errors == [{"line": 100, "field": "prompt", "message": "record too long: more than 16 MiB"}]
    assert peak < 64 << 20, f"{peak >> 20} MiB of Python objects at once"


# ---------------------------------------------------------------------------------------------
# iter_conversations: the valid records, normalised, streamed (the training worker's input)


def _want_messages(report) -> list:
    """Normalised conversations of the valid records, from the validator's own preview."""
    return [p["messages"] for p in report.preview if "messages" in p]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_iter_conversations_normalises_like_the_validator(tmp_path, fmt, file_type):
    from app.datasets.validation import iter_conversations

    n = 15  # below PREVIEW_ROWS, so the preview lists every record
    recs = [record(fmt, i) for i in range(n)]
    if file_type == "jsonl":
        items: list = [json.dumps(r) for r in recs]
        items[3] = "{not json"
        items[5] = json.dumps({"nothing": "useful"})
        items[7] = ""
        path = write_jsonl(tmp_path / "d.jsonl", items)
    elif file_type == "csv":
        cols = _columns(fmt, n)
        path = tmp_path / "d.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(list(cols))
            for i, row in enumerate(zip(*cols.values(), strict=True)):
                w.writerow([""] * len(row) if i == 4 else list(row))  # row 4: empty fields, invalid
    else:
        path = tmp_path / "d.parquet"
        table = pa.table({"messages": [r["messages"] for r in recs]}) if fmt == "chat" else pa.table(_columns(fmt, n))
        pq.write_table(table, path, row_group_size=4)
    name = f"d.{file_type}"
    report = validate_file(path, name)
    assert report.format == fmt and report.valid_rows < report.rows or file_type == "parquet"
    got = list(iter_conversations(path, name, file_type=None, fmt=None))
    assert got == _want_messages(report)
    assert len(got) == report.valid_rows
    assert got == list(iter_conversations(path, name, file_type=file_type, fmt=fmt))


def test_iter_conversations_values(tmp_path):
    from app.datasets.validation import iter_conversations

    path = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"instruction": "Translate", "input": "bonjour", "output": "hello"},
            {"instruction": "Say hi", "input": "  ", "output": "hi"},
            {"instruction": "", "output": "dropped: empty instruction"},
        ],
    )
    assert list(iter_conversations(path, "a.jsonl", file_type="jsonl", fmt="alpaca")) == [
        [{"role": "user", "content": "Translate\n\nbonjour"}, {"role": "assistant", "content": "hello"}],
        [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}],
    ]
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}, {"text": 3}])
    assert list(iter_conversations(path, "t.jsonl", file_type=None, fmt=None)) == [
        [{"role": "text", "content": "hello world"}]
    ]
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U", "weight": 1},
        {"role": "assistant", "content": "A", "weight": 0},
    ]
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + orjson.dumps({"messages": msgs}) + b"\r\n")
    assert list(iter_conversations(path, "bom.jsonl", file_type=None, fmt=None)) == [
        [{"role": m["role"], "content": m["content"]} for m in msgs]
    ]
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n\n")
    assert list(iter_conversations(empty, "empty.jsonl", file_type=None, fmt=None)) == []
    with pytest.raises(DatasetFormatError):
        iter_conversations(path, "bom.jsonl", file_type="xml", fmt=None)


def test_iter_conversations_streams_and_stops_early(tmp_path):
    """A large CSV is handed over record by record; closing the iterator early stops the reader."""
    import threading

    from app.datasets.validation import iter_conversations

    path = tmp_path / "big.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "completion"])
        for i in range(20000):
            w.writerow([f"p{i}", f"c{i}"])
    it = iter_conversations(path, "big.csv", file_type=None, fmt=None)
    first = [next(it) for _ in range(3)]
    assert first[2] == [{"role": "user", "content": "p2"}, {"role": "assistant", "content": "c2"}]
    it.close()
    assert not [t for t in threading.enumerate() if t.name == "iter-conversations"]
    assert sum(1 for _ in iter_conversations(path, "big.csv", file_type="csv", fmt=None)) == 20000

    bad = tmp_path / "bad.csv"
    bad.write_text("text\n" + "x" * 10 + "\n", encoding="utf-8")
    assert list(iter_conversations(bad, "bad.csv", file_type="csv", fmt="chat")) == []  # no 'messages' column
    bad.write_text("foo,bar\n1,2\n", encoding="utf-8")
    with pytest.raises(DatasetFormatError, match="cannot tell the dataset format"):  # raised in the reader thread
        list(iter_conversations(bad, "bad.csv", file_type="csv", fmt=None))


# ---------------------------------------------------------------------------------------------
# errors quote what the file holds by a short prefix: they are kept with the dataset and shown


def test_errors_quote_a_huge_value_by_a_short_prefix(tmp_path):
    huge = "r" * 200_000
    records = [
        {"messages": [{"role": huge, "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"messages": [{"role": "user", "content": "hi", "weight": [huge]}, {"role": "assistant", "content": "x"}]},
    ]
    report = validate_file(write_jsonl(tmp_path / "d.jsonl", records * 3), "d.jsonl")
    assert report.error_count == len(report.errors) == 6
    role, weight = report.errors[:2]
    assert role["field"] == "messages[0].role"
    assert role["message"] == f"invalid role '{'r' * 200}'…: expected one of 'system', 'user', 'assistant'"
    assert weight["field"] == "messages[0].weight" and weight["message"].startswith("weight must be 0 or 1, got [")
    assert len(orjson.dumps(report.errors)) < 6 * 400, "the errors kept are a few hundred bytes each"
    assert all(len(p.get("error", "")) < 400 for p in report.preview)

    header = tmp_path / "d.csv"  # a header of unknown columns, one of them huge
    header.write_text(f"question,{huge}\nhi,there\n")
    with pytest.raises(DatasetFormatError) as exc:
        validate_file(str(header), "d.csv")
    assert len(str(exc.value)) < 600 and f"'{'r' * 100}" in str(exc.value), str(exc.value)[:600]
