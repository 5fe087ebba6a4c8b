"""Streaming validation of fine-tuning datasets (JSONL, CSV, Parquet).

Pure Python: stdlib + orjson + numpy (+ pyarrow, imported only for Parquet). No database or web
imports, so the worker can call :func:`validate_file` directly and the tests can run it on files.

Memory stays flat as the file grows: the file is streamed (JSONL and CSV line by line, each line
at most 16 MiB; Parquet in batches of at most 1024 rows that the footer says decode to at most about
64 MiB, made into Python objects 16 MiB at a time, each record at most 16 MiB) and each valid record
leaves behind only two int64 values (a 64-bit duplicate hash and a packed ``chars << 24 |
system_flag << 23 | n_messages`` word), plus one 16-byte entry per skipped line (blank or invalid)
to recover physical line numbers.
Lengths and the histogram are then summarised block by block; the lengths are freed before the
duplicate pass, whose only O(n) extra is one sorted copy of the hashes.

JSONL speed: after the first PREVIEW_ROWS records, each line goes through a fast check (inline,
no normalised dicts, the common system/user/assistant shape unrolled) that only *accepts* records;
anything it declines goes to the slow, authoritative check that produces the error message.

Duplicate keys:
  * JSONL: Python's 64-bit ``hash`` of the raw record line (the final line is hashed as if it ended in
    a newline). Records that differ only in JSON formatting (key order, spacing, escapes) or carry
    different extra fields (e.g. ``weight``) are therefore *not* reported as duplicates. This keeps
    the per-record path fast (one C call, no tuple building).
  * CSV and Parquet: hash of the normalised conversation (roles + contents).
  A 64-bit hash collision could, in theory, report a false duplicate (odds ~ n^2 / 2^65).

Per-record checks stop at the first problem, so every record has at most one error.
"""

from __future__ import annotations

import csv
import functools
import importlib
import itertools
import math
import os
import queue
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import orjson

from app.core.echo import STORED_CHARS, clip, echo

FILE_TYPES = ("jsonl", "csv", "parquet")
FORMATS = ("chat", "prompt_completion", "alpaca", "text", "preference")
MAX_LISTED = 100  # errors / duplicates listed in full; beyond that only counted

PREVIEW_ROWS = 20
PREVIEW_CHARS = 2000
PROGRESS_INTERVAL_S = 0.25
HISTOGRAM_BINS = 30
CHAT_ROLES = ("system", "user", "assistant")

_CHUNK = 1 << 16  # JSONL read buffer (bytes)
_MAX_LINE = 16 << 20  # longer JSONL lines are read in pieces and reported, never held whole
_PROGRESS_EVERY_LINES = 4096
_HEAD = 1 << 16  # bytes read to sniff the file type
_DETECT_MAX_RECORDS = 1000  # non-blank JSONL lines inspected to find the first parseable object
_DETECT_MAX_BYTES = 16 << 20
_PARQUET_BATCH = 1024  # rows per Parquet batch at most
_PARQUET_BATCH_BYTES = 64 << 20  # what a batch may decode to in Arrow, by the footer's bounds (see _row_bytes)
_PARQUET_SLICE_BYTES = 16 << 20  # what the records made into Python objects at once may decode to
_PARQUET_COUNT_BATCH = 1 << 16  # rows per batch when only dictionary indices are counted
_VALUE_BYTES = 16  # counted for each value on top of its text: about what it costs in JSON (quotes, key, comma)
_FIXED_WIDTH = {"BOOLEAN": 1, "INT32": 4, "INT64": 8, "INT96": 12, "FLOAT": 4, "DOUBLE": 8}
_DICTIONARY_ENCODINGS = frozenset({"PLAIN_DICTIONARY", "RLE_DICTIONARY"})
_CSV_FIELD_LIMIT = 64 << 20

_EXTENSIONS = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}

# Columns / keys each format needs (and may use).
_REQUIRED = {
    "chat": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
    "preference": ("prompt", "chosen", "rejected"),
}
_OPTIONAL = {"alpaca": ("input",)}

# Packed per-record word: chars << 24 | system_flag << 23 | n_messages.
_SYS_FLAG = 1 << 23
_N_MASK = _SYS_FLAG - 1
_CHARS_SHIFT = 24

_S, _U, _A = "system", "user", "assistant"
_MISSING = object()


class DatasetFormatError(ValueError):
    """The file type or the dataset format cannot be determined, or an unknown one was requested."""


class DatasetTooLargeError(DatasetFormatError):
    """The records would decode to more than a dataset may hold (a Parquet file that decompresses a
    thousandfold, or whose values all point to one long dictionary entry)."""


class _RecordError(Exception):
    """One record failed a check (slow, authoritative path)."""

    def __init__(self, field_name: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field_name
        self.message = message


class _NotFast(Exception):
    """The fast path declines a record; the slow path decides."""


@dataclass
class ValidationReport:
    file_type: str
    format: str | None  # None only for an empty file whose format was not given
    rows: int = 0
    valid_rows: int = 0
    errors: list[dict] = field(default_factory=list)
    error_count: int = 0
    duplicates: list[dict] = field(default_factory=list)
    duplicate_count: int = 0
    stats: dict = field(default_factory=dict)
    preview: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error_count == 0 and self.rows > 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data


# ---------------------------------------------------------------------------------------------
# File type and format detection


def detect_file_type(filename: str, head: bytes) -> str:
    """The file type from the name's extension, else by sniffing the first bytes."""
    ext = os.path.splitext(filename.lower())[1]
    if ext in _EXTENSIONS:
        return _EXTENSIONS[ext]
    if head.startswith(b"PAR1"):
        return "parquet"
    if b"\x00" in head[:4096]:
        raise DatasetFormatError(
            f"{filename}: cannot tell the file type: it looks like a binary file, not JSONL, CSV or Parquet"
        )
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:]
    for line in head.splitlines():
        stripped = line.strip()
        if stripped:
            return "jsonl" if stripped.startswith(b"{") else "csv"
    return "csv"


def _describe_formats() -> str:
    return (
        "'messages' (chat), 'prompt' + 'completion' (prompt_completion), "
        "'instruction' + 'output' [+ 'input'] (alpaca), 'text' (text) "
        "or 'prompt' + 'chosen' + 'rejected' (preference)"
    )


def _format_from_keys(keys, filename: str, what: str) -> str:
    keys = set(keys)
    if "messages" in keys:
        return "chat"
    if {"prompt", "chosen", "rejected"} <= keys:
        return "preference"
    if "prompt" in keys and "completion" in keys:
        return "prompt_completion"
    if "instruction" in keys and "output" in keys:
        return "alpaca"
    if "text" in keys:
        return "text"
    seen = clip(", ".join(echo(k) for k in sorted(map(str, keys)))) or "none"
    raise DatasetFormatError(
        f"{filename}: cannot tell the dataset format from the {what} ({seen}); expected {_describe_formats()}"
    )


def _detect_jsonl_format(path: str, filename: str) -> str | None:
    """Format from the keys of the first JSON object in the file; None if the file has no records."""
    nonblank = 0
    first = b""
    read = 0
    with open(path, "rb") as f:
        for line in iter(functools.partial(f.readline, _MAX_LINE), b""):
            read += len(line)
            if nonblank == 0 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            if not line.strip():
                continue
            nonblank += 1
            if nonblank == 1:
                first = line.lstrip()[:1]
            if len(line) >= _MAX_LINE and not line.endswith(b"\n"):  # too long to be a record
                while True:
                    piece = f.readline(_MAX_LINE)
                    read += len(piece)
                    if not piece or piece.endswith(b"\n"):
                        break
                obj = None
            else:
                try:
                    obj = orjson.loads(line)
                except orjson.JSONDecodeError:
                    obj = None
            if type(obj) is dict:
                return _format_from_keys(obj.keys(), filename, "keys of the first record")
            if nonblank >= _DETECT_MAX_RECORDS or read >= _DETECT_MAX_BYTES:
                break
    if nonblank == 0:
        return None
    hint = ""
    if first == b"[":
        hint = " (it looks like a JSON array; upload JSON Lines instead: one object per line)"
    raise DatasetFormatError(
        f"{filename}: cannot tell the dataset format: none of the first {nonblank} records is a JSON object{hint}"
    )


# ---------------------------------------------------------------------------------------------
# Record checks. The slow checks are the single source of truth; they return the packed length
# word and the normalised conversation (a tuple of (role, content) pairs). The fast checks only
# accept records the slow checks would accept, and raise anything to defer to them.


def _tname(value: Any) -> str:
    if value is None:
        return "null"
    t = type(value)
    if t is str:
        return "string"
    if t is dict:
        return "object"
    return t.__name__


def _str_field(obj: dict, key: str, empty_message: str | None = None) -> str:
    if key not in obj:
        raise _RecordError(key, f"missing required field '{key}'")
    value = obj[key]
    if type(value) is not str:
        raise _RecordError(key, f"wrong type: expected string, got {_tname(value)}")
    if not value or value.isspace():
        raise _RecordError(key, empty_message or f"empty {key}")
    return value


def _check_chat(obj: dict) -> tuple[int, tuple]:
    if "messages" not in obj:
        raise _RecordError("messages", "missing required field 'messages'")
    msgs = obj["messages"]
    if type(msgs) is not list:
        raise _RecordError("messages", f"wrong type: expected list, got {_tname(msgs)}")
    if not msgs:
        raise _RecordError("messages", "must be a non-empty list of messages")
    convo = []
    chars = 0
    sys_flag = 0
    prev = None
    seen_assistant = False
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if type(m) is not dict:
            raise _RecordError(where, f"wrong type: expected object, got {_tname(m)}")
        fr = where + ".role"
        if "role" not in m:
            raise _RecordError(fr, "missing required field 'role'")
        role = m["role"]
        if type(role) is not str:
            raise _RecordError(fr, f"wrong type: expected string, got {_tname(role)}")
        if role not in CHAT_ROLES:
            raise _RecordError(fr, f"invalid role {echo(role)}: expected one of 'system', 'user', 'assistant'")
        if role == _S:
            if prev == _S:
                raise _RecordError(fr, "only one 'system' turn is allowed")
            if prev is not None:
                raise _RecordError(fr, f"'system' turn must come first; found after a '{prev}' turn")
            sys_flag = _SYS_FLAG
        else:
            expected = _A if prev == _U else _U
            if role != expected:
                if prev is None or prev == _S:
                    lead = "the first turn" if prev is None else "the first turn after 'system'"
                    raise _RecordError(fr, f"{lead} must be 'user', got '{role}'")
                raise _RecordError(fr, f"expected '{expected}' after '{prev}', got '{role}'")
            if role == _A:
                seen_assistant = True
        fc = where + ".content"
        if "content" not in m:
            raise _RecordError(fc, "missing required field 'content'")
        content = m["content"]
        if type(content) is not str:
            raise _RecordError(fc, f"wrong type: expected string, got {_tname(content)}")
        if not content or content.isspace():
            raise _RecordError(fc, "empty content")
        if "weight" in m:
            w = m["weight"]
            if type(w) is not int or w not in (0, 1):
                raise _RecordError(where + ".weight", f"weight must be 0 or 1, got {echo(w)}")
        chars += len(content)
        convo.append((role, content))
        prev = role
    if not seen_assistant:
        raise _RecordError("messages", "there must be at least one 'assistant' turn")
    if prev != _A:
        raise _RecordError(
            f"messages[{len(msgs) - 1}].role", "the last turn must be 'assistant' (it is the training target)"
        )
    return chars << _CHARS_SHIFT | sys_flag | len(msgs), tuple(convo)


def _check_prompt_completion(obj: dict) -> tuple[int, tuple]:
    prompt = _str_field(obj, "prompt")
    completion = _str_field(obj, "completion")
    return (len(prompt) + len(completion)) << _CHARS_SHIFT | 2, ((_U, prompt), (_A, completion))


def _check_preference(obj: dict) -> tuple[int, tuple]:
    """A preference pair as TRL takes it: ``prompt``, ``chosen`` and ``rejected`` strings (its standard
    form), or a chat ``prompt`` ending with a user turn and each answer a list of one assistant message
    (its conversational form). Normalised to the prompt's turns, the chosen answer as the assistant's,
    then the rejected one (role ``rejected``)."""
    if "prompt" not in obj:
        raise _RecordError("prompt", "missing required field 'prompt'")
    prompt = obj["prompt"]
    if type(prompt) is str:
        p, c, r = (_str_field(obj, k) for k in ("prompt", "chosen", "rejected"))
        return (len(p) + len(c) + len(r)) << _CHARS_SHIFT | 3, ((_U, p), (_A, c), ("rejected", r))
    if type(prompt) is not list:
        raise _RecordError("prompt", f"wrong type: expected string or list of messages, got {_tname(prompt)}")
    if not prompt:
        raise _RecordError("prompt", "must be a non-empty list of messages")
    if type(prompt[-1]) is dict and prompt[-1].get("role") != _U:
        raise _RecordError(f"prompt[{len(prompt) - 1}].role", "the last turn must be 'user' (the answers reply to it)")
    c, r = (_answer(obj, k) for k in ("chosen", "rejected"))
    try:
        packed, convo = _check_chat({"messages": [*prompt, {"role": _A, "content": c}]})
    except _RecordError as exc:
        raise _RecordError("prompt" + (exc.field or "messages").removeprefix("messages"), exc.message) from None
    return packed + ((len(r) << _CHARS_SHIFT) | 1), (*convo, ("rejected", r))


def _answer(obj: dict, key: str) -> str:
    """A preference answer: a string, or a list of one assistant message."""
    if key not in obj:
        raise _RecordError(key, f"missing required field '{key}'")
    value = obj[key]
    if type(value) is str:
        return _str_field(obj, key)
    if type(value) is not list or len(value) != 1 or type(value[0]) is not dict:
        raise _RecordError(key, f"expected a string or a list of one assistant message, got {_tname(value)}")
    if value[0].get("role") != _A:
        raise _RecordError(f"{key}[0].role", f"must be 'assistant', got {echo(value[0].get('role'))}")
    try:
        return _str_field(value[0], "content")
    except _RecordError as exc:
        raise _RecordError(f"{key}[0].{exc.field}", exc.message) from None


def _check_alpaca(obj: dict) -> tuple[int, tuple]:
    instruction = _str_field(obj, "instruction")
    inp = obj.get("input")
    if inp is not None and type(inp) is not str:
        raise _RecordError("input", f"wrong type: expected string, got {_tname(inp)}")
    output = _str_field(obj, "output")
    user = instruction + "\n\n" + inp if inp and not inp.isspace() else instruction
    return (len(user) + len(output)) << _CHARS_SHIFT | 2, ((_U, user), (_A, output))


def _check_text(obj: dict) -> tuple[int, tuple]:
    text = _str_field(obj, "text")
    return len(text) << _CHARS_SHIFT | 1, (("text", text),)


_CHECK = {
    "chat": _check_chat,
    "prompt_completion": _check_prompt_completion,
    "alpaca": _check_alpaca,
    "text": _check_text,
    "preference": _check_preference,
}


def _fast_chat(o):
    # Any exception (KeyError, TypeError, AttributeError, _NotFast) sends the record to _check_chat.
    msgs = o["messages"]
    if len(msgs) == 3:  # the common system/user/assistant shape, unrolled
        m0, m1, m2 = msgs
        c0 = m0["content"]
        c1 = m1["content"]
        c2 = m2["content"]
        if (
            m0["role"] == _S
            and m1["role"] == _U
            and m2["role"] == _A
            and len(m0) + len(m1) + len(m2) == 6  # exactly role + content each: no weight to check
            and c0
            and c1
            and c2
            and not (c0.isspace() or c1.isspace() or c2.isspace())  # also raises on non-strings
        ):
            return (len(c0) + len(c1) + len(c2)) << 24 | 8388611  # _SYS_FLAG | 3
        raise _NotFast
    chars = 0
    flag = 0
    want = _U
    r = None
    for m in msgs:
        r = m["role"]
        if r == want:
            want = _A if want is _U else _U
        elif r == _S and not chars:  # chars is 0 only before the first message
            flag = 8388608  # _SYS_FLAG
        else:
            raise _NotFast
        c = m["content"]
        if c.isspace() or not c or len(m) > 2:
            raise _NotFast
        chars += len(c)
    if r != _A:
        raise _NotFast
    return chars << 24 | flag | len(msgs)


def _fast_prompt_completion(o):
    p = o["prompt"]
    c = o["completion"]
    if p.isspace() or c.isspace() or not p or not c:
        raise _NotFast
    return (len(p) + len(c)) << 24 | 2


def _fast_alpaca(o):
    ins = o["instruction"]
    out = o["output"]
    if ins.isspace() or out.isspace() or not ins or not out:
        raise _NotFast
    inp = o.get("input")
    if inp is None or inp == "":
        return (len(ins) + len(out)) << 24 | 2
    if inp.isspace():  # raises on non-strings too
        raise _NotFast
    return (len(ins) + len(inp) + 2 + len(out)) << 24 | 2


def _fast_text(o):
    t = o["text"]
    if t.isspace() or not t:
        raise _NotFast
    return len(t) << 24 | 1


def _fast_preference(o):
    p = o["prompt"]
    c = o["chosen"]
    r = o["rejected"]
    if p.isspace() or c.isspace() or r.isspace() or not p or not c or not r:  # raises on lists: the slow path
        raise _NotFast
    return (len(p) + len(c) + len(r)) << 24 | 3


_FAST = {
    "chat": _fast_chat,
    "prompt_completion": _fast_prompt_completion,
    "alpaca": _fast_alpaca,
    "text": _fast_text,
    "preference": _fast_preference,
}


# ---------------------------------------------------------------------------------------------
# Accumulation


class _Progress:
    def __init__(self, callback: Callable[[int, int], None] | None, total: int) -> None:
        self.callback = callback
        self.total = total
        self.next_at = time.monotonic() + PROGRESS_INTERVAL_S

    def maybe(self, done: int) -> None:
        if self.callback is None:
            return
        now = time.monotonic()
        if now >= self.next_at:
            self.callback(min(done, self.total), self.total)
            self.next_at = now + PROGRESS_INTERVAL_S

    def final(self) -> None:
        if self.callback is not None:
            self.callback(self.total, self.total)


def _preview_messages(convo: tuple) -> list[dict]:
    return [{"role": r, "content": c[:PREVIEW_CHARS]} for r, c in convo]


class _Accumulator:
    """Counts, listed errors, preview and the compact per-record arrays."""

    def __init__(self, fmt: str | None) -> None:
        self.fmt = fmt
        self.hashes = array("q")  # duplicate key per valid record
        self.packed = array("q")  # chars << 24 | system_flag << 23 | n_messages per valid record
        # Line numbers: valid record k sits on line k + 1 + off(k), where off changes only at
        # skipped lines (blank, invalid, CSV header / multi-line records). (k, off) change points:
        self.ev_k = array("q")
        self.ev_off = array("q")
        self.off = 0
        self.invalid = 0
        self.errors: list[dict] = []
        self.error_count = 0
        self.preview: list[dict] = []

    @property
    def rows(self) -> int:
        return len(self.packed) + self.invalid

    def _set_off(self, off: int) -> None:
        self.off = off
        k = len(self.packed)
        if self.ev_k and self.ev_k[-1] == k:
            self.ev_off[-1] = off
        else:
            self.ev_k.append(k)
            self.ev_off.append(off)

    def file_error(self, line: int, message: str) -> None:
        message = clip(message, STORED_CHARS)
        self.error_count += 1
        if len(self.errors) < MAX_LISTED:
            self.errors.append({"line": line, "field": None, "message": message})

    def add_invalid(self, line: int, field_name: str | None, message: str) -> None:
        message = clip(message, STORED_CHARS)
        if self.rows < PREVIEW_ROWS:
            self.preview.append({"line": line, "error": f"{field_name}: {message}" if field_name else message})
        self.invalid += 1
        self.error_count += 1
        if len(self.errors) < MAX_LISTED:
            self.errors.append({"line": line, "field": field_name, "message": message})

    def add_valid(self, line: int, packed: int, convo: tuple, key: int | None) -> None:
        """A valid record; key None means the caller appends the hash itself (JSONL)."""
        if line != len(self.packed) + 1 + self.off:
            self._set_off(line - len(self.packed) - 1)
        if self.rows < PREVIEW_ROWS:
            self.preview.append({"line": line, "messages": _preview_messages(convo)})
        self.packed.append(packed)
        if key is not None:
            self.hashes.append(key)

    def check(self, line: int, obj: Any, key_from_convo: bool) -> None:
        if type(obj) is not dict:
            self.add_invalid(line, None, f"expected a JSON object, got {_tname(obj)}")
            return
        assert self.fmt is not None, "records are checked once the format is known"
        try:
            packed, convo = _CHECK[self.fmt](obj)
        except _RecordError as exc:
            self.add_invalid(line, exc.field, exc.message)
            return
        self.add_valid(line, packed, convo, hash(convo) if key_from_convo else None)

    # -- results ------------------------------------------------------------------------------

    def lines_of(self, idx: np.ndarray) -> np.ndarray:
        if not len(self.ev_k):
            return idx + 1
        ev_k = np.frombuffer(self.ev_k, dtype=np.int64)
        ev_off = np.frombuffer(self.ev_off, dtype=np.int64)
        j = np.searchsorted(ev_k, idx, side="right") - 1
        off = np.where(j >= 0, ev_off[np.maximum(j, 0)], 0)
        return idx + 1 + off

    def duplicates(self) -> tuple[list[dict], int]:
        """(first MAX_LISTED duplicates by line, total). Extra memory: one sorted copy of the keys."""
        n = len(self.hashes)
        if n < 2:
            return [], 0
        h = np.frombuffer(self.hashes, dtype=np.int64)
        hs = np.sort(h)
        same = hs[1:] == hs[:-1]
        dup_keys = np.unique(hs[1:][same])
        del hs, same
        if not dup_keys.size:
            return [], 0
        # positions of every record whose key occurs more than once (found block by block)
        found = []
        for s in range(0, n, _BLOCK):
            block = h[s : s + _BLOCK]
            idx = np.searchsorted(dup_keys, block)
            np.minimum(idx, dup_keys.size - 1, out=idx)
            found.append(np.flatnonzero(dup_keys[idx] == block) + s)
        pos = np.concatenate(found)
        keys = h[pos]
        order = np.argsort(keys, kind="stable")  # equal keys keep file order: first occurrence first
        pos, keys = pos[order], keys[order]
        starts = np.empty(pos.size, dtype=bool)
        starts[0] = True
        np.not_equal(keys[1:], keys[:-1], out=starts[1:])
        first_of = pos[np.maximum.accumulate(np.where(starts, np.arange(pos.size), 0))]
        later, first = pos[~starts], first_of[~starts]
        count = int(later.size)
        keep = np.argsort(later, kind="stable")[:MAX_LISTED]
        later_lines = self.lines_of(later[keep]).tolist()
        first_lines = self.lines_of(first[keep]).tolist()
        return [{"line": int(a), "duplicate_of": int(b)} for a, b in zip(later_lines, first_lines, strict=True)], count

    def stats(self) -> dict:
        """Length statistics over the valid records, computed block by block (small temporaries)."""
        n = len(self.packed)
        if not n:
            return {}
        p = np.frombuffer(self.packed, dtype=np.int64)

        def blocks():
            for s in range(0, n, _BLOCK):
                b = p[s : s + _BLOCK]
                chars = b >> _CHARS_SHIFT
                msgs = b & _N_MASK
                yield b, chars, msgs, (chars + 3) // 4 + 4 * msgs

        dist_chars, dist_tokens = _Dist(), _Dist()
        system = turns = 0
        for b, chars, msgs, tokens in blocks():
            dist_chars.first_pass(chars)
            dist_tokens.first_pass(tokens)
            if self.fmt == "chat":
                sys_here = int(np.count_nonzero(b & _SYS_FLAG))
                system += sys_here
                turns += int(msgs.sum()) - sys_here
        lo, hi = dist_tokens.lo, dist_tokens.hi
        span = hi - lo + 1
        width = -(-span // HISTOGRAM_BINS)
        nbins = -(-span // width)
        hist = np.zeros(nbins, dtype=np.int64)
        for _, chars, _, tokens in blocks():
            dist_chars.second_pass(chars)
            dist_tokens.second_pass(tokens)
            hist += np.bincount((tokens - lo) // width, minlength=nbins)
        if self.fmt == "chat":
            roles = {"system": system, "user": turns // 2, "assistant": turns // 2}
        elif self.fmt == "text":
            roles = {"system": 0, "user": 0, "assistant": 0, "text": n}
        else:
            roles = {"system": 0, "user": n, "assistant": n}
        return {
            "chars": dist_chars.summary(),
            "tokens": dist_tokens.summary(),
            "histogram": {  # equal-width integer bins over [min, max]; bin i is [edges[i], edges[i+1])
                "unit": "tokens",
                "edges": [lo + width * i for i in range(nbins + 1)],
                "counts": [int(c) for c in hist.tolist()],
            },
            "roles": roles,
            "tokens_total": dist_tokens.total,
            "token_estimate": "chars/4",
        }


_BLOCK = 1 << 16  # rows per numpy block when summarising (keeps temporaries to a few MB)
_VALUE_COUNTS_MAX_RANGE = 1 << 21  # exact percentiles from value counts when max - min is below this


class _Dist:
    """min / median / p95 / max / mean of integer values seen in blocks, without an O(n) copy
    (value counts over [min, max]; falls back to collecting the values when that range is huge)."""

    def __init__(self) -> None:
        self.n = 0
        self.total = 0
        self.lo: int = 0
        self.hi: int = 0
        self.counts: np.ndarray | None = None
        self.values: list[np.ndarray] = []

    def first_pass(self, v: np.ndarray) -> None:
        lo, hi = int(v.min()), int(v.max())
        self.lo, self.hi = (lo, hi) if not self.n else (min(self.lo, lo), max(self.hi, hi))
        self.n += int(v.size)
        self.total += int(v.sum())

    def second_pass(self, v: np.ndarray) -> None:
        span = self.hi - self.lo + 1
        if span <= _VALUE_COUNTS_MAX_RANGE:
            c = np.bincount(v - self.lo, minlength=span)
            self.counts = c if self.counts is None else self.counts + c
        else:
            self.values.append(v.astype(np.uint32 if self.hi < 1 << 32 else np.int64))

    def _percentiles(self, qs: tuple[float, ...]) -> list[float]:
        if self.counts is None:
            return [float(x) for x in np.percentile(np.concatenate(self.values), qs)]
        cum = np.cumsum(self.counts)
        out = []
        for q in qs:  # numpy's default "linear" method on the sorted values
            pos = q / 100 * (self.n - 1)
            k = math.floor(pos)
            ranks = np.array([k, min(k + 1, self.n - 1)])
            v0, v1 = (np.searchsorted(cum, ranks, side="right") + self.lo).tolist()
            t, d = pos - k, v1 - v0
            out.append(v0 + d * t if t < 0.5 else v1 - d * (1 - t))  # numpy's _lerp
        return out

    def summary(self) -> dict:
        median, p95 = self._percentiles((50, 95))
        return {
            "min": self.lo,
            "median": round(median, 1),
            "p95": round(p95, 1),
            "max": self.hi,
            "mean": round(self.total / self.n, 1),
        }


# ---------------------------------------------------------------------------------------------
# Scanners


def _scan_jsonl(path: str, acc: _Accumulator, prog: _Progress) -> None:
    assert acc.fmt is not None, "a JSONL file is scanned once its format is known"
    fast = _FAST[acc.fmt]
    loads = orjson.loads
    packed = acc.packed
    append = packed.append
    hashes = acc.hashes
    happend = hashes.append
    limit = _MAX_LINE
    f = open(path, "rb", buffering=_CHUNK)

    def slow(line: bytes) -> None:
        """Every record the fast path declines, and the first PREVIEW_ROWS records."""
        lineno = len(packed) + acc.off + 1
        if len(line) >= limit and not line.endswith(b"\n"):
            acc._set_off(acc.off + 1)
            acc.add_invalid(lineno, None, f"record too long: more than {limit >> 20} MiB on one line")
            while True:  # skip the rest of the line, a piece at a time
                piece = f.readline(limit)
                if not piece or piece.endswith(b"\n"):
                    return
        try:
            obj = loads(line)
        except orjson.JSONDecodeError as exc:
            err: Exception = exc
            obj = _MISSING
            if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte order mark
                try:
                    obj = loads(line[3:])
                except orjson.JSONDecodeError as exc2:
                    err = exc2
            if obj is _MISSING:
                acc._set_off(acc.off + 1)
                if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):
                    line = line[3:]
                if line.strip(b" \t\r\n"):  # JSON whitespace only: a blank line, skipped silently
                    acc.add_invalid(lineno, None, f"invalid JSON: {err}")
                return
        before = len(packed)
        acc.check(lineno, obj, key_from_convo=False)
        if len(packed) == before:
            acc._set_off(acc.off + 1)
        else:
            happend(hash(line if line.endswith(b"\n") else line + b"\n"))

    with f:
        # One line in memory at a time, each at most _MAX_LINE bytes; islice blocks (C-level
        # iteration, no per-line counter) give a place to report progress.
        lines = iter(functools.partial(f.readline, limit), b"")
        for line in lines:  # the first records take the slow path, for the preview
            slow(line)
            if acc.rows >= PREVIEW_ROWS:
                break
        last = b"\n"
        while True:
            line = None
            for line in itertools.islice(lines, _PROGRESS_EVERY_LINES):
                if len(line) < limit:
                    try:
                        append(fast(loads(line)))
                        happend(hash(line))
                        continue
                    except Exception:
                        pass
                slow(line)
            if line is None:
                break
            last = line
            prog.maybe(f.tell())
    # Hash the file's last line as if it ended in a newline, like every other line.
    if not last.endswith(b"\n") and len(packed) and not (acc.ev_k and acc.ev_k[-1] == len(packed)):
        fixed = hash(last + b"\n")
        if hashes[-1] != fixed and hashes[-1] == hash(last):
            hashes[-1] = fixed


def _scan_csv(path: str, filename: str, acc: _Accumulator, prog: _Progress) -> None:
    if csv.field_size_limit() < _CSV_FIELD_LIMIT:
        csv.field_size_limit(_CSV_FIELD_LIMIT)
    bad_utf8: list[int] = []  # physical lines that are not valid UTF-8 (decoded with U+FFFD instead)
    too_long: list[int] = []  # a line over _MAX_LINE bytes: reading stops there (memory stays bounded)
    # The bytes of the record being read: a quoted field can span lines, and a record hold many fields.
    # The line where a record passes _CSV_FIELD_LIMIT bytes is the last one read.
    record = [0]
    long_record: list[int] = []

    def text_lines(f):
        # Decode line by line (not in 8 KiB blocks) so an invalid byte is pinned to its line.
        # csv.reader counts the lines it takes from here, so reader.line_num is the physical line.
        # Lines end at \n, \r\n or a lone \r (old Mac exports), as in universal-newline mode.
        n = 0
        for raw_line in iter(functools.partial(f.readline, _MAX_LINE), b""):
            if len(raw_line) >= _MAX_LINE and not raw_line.endswith(b"\n"):
                too_long.append(n + 1)
                return
            record[0] += len(raw_line)
            if record[0] > _CSV_FIELD_LIMIT:
                long_record.append(n + 1)
                return
            if n == 0 and raw_line.startswith(b"\xef\xbb\xbf"):
                raw_line = raw_line[3:]
            cr = raw_line.find(b"\r")
            end = len(raw_line)
            if cr == -1 or cr == end - 1 or (cr == end - 2 and raw_line[-1:] == b"\n"):
                parts = (raw_line,)
            else:
                parts = raw_line.splitlines(True)
            for b in parts:
                n += 1
                try:
                    yield b.decode("utf-8")
                except UnicodeDecodeError:
                    bad_utf8.append(n)
                    yield b.decode("utf-8", "replace")

    with open(path, "rb") as raw:
        reader = csv.reader(text_lines(raw))
        header = None
        try:
            while header is None:
                record[0] = 0
                row = next(reader, None)
                if row is None:
                    break
                header = row or None
        except csv.Error as exc:
            raise DatasetFormatError(f"{filename}: cannot read the CSV header: {exc}") from exc
        if too_long:
            raise DatasetFormatError(
                f"{filename}: cannot read the CSV header: line 1 is longer than {_MAX_LINE >> 20} MiB"
            )
        if long_record:
            raise DatasetFormatError(
                f"{filename}: cannot read the CSV header: it is longer than {_CSV_FIELD_LIMIT >> 20} MiB"
            )
        if header is None:
            return  # no records
        header_line = reader.line_num
        cols = [c.strip() for c in header]
        if acc.fmt is None:
            acc.fmt = _format_from_keys(cols, filename, "CSV columns")
        missing = [c for c in _REQUIRED[acc.fmt] if c not in cols]
        if bad_utf8 or missing:
            message = (
                "the header is not valid UTF-8 text"
                if bad_utf8
                else f"missing required column(s) for format '{acc.fmt}': {', '.join(missing)} "
                f"(the header has: {clip(', '.join(cols)) or 'nothing'})"
            )
            acc.file_error(header_line, message)
            return
        wanted = _REQUIRED[acc.fmt] + _OPTIONAL.get(acc.fmt, ())
        index = [(name, cols.index(name)) for name in wanted if name in cols]
        chat = acc.fmt == "chat"
        n = 0
        while True:
            start = reader.line_num + 1
            record[0] = 0
            try:
                row = next(reader)
            except StopIteration:
                if too_long:
                    acc.file_error(
                        too_long[0], f"line {too_long[0]} is longer than {_MAX_LINE >> 20} MiB; stopped reading here"
                    )
                break
            except csv.Error as exc:
                if long_record:
                    acc.file_error(start, _long_record(start))
                    break
                acc.add_invalid(start, None, f"CSV error: {exc}")
                continue
            if long_record:
                acc.file_error(start, _long_record(start))
                break
            if not row:
                continue  # blank line
            if bad_utf8 and bad_utf8[-1] >= start:
                at = next(x for x in bad_utf8 if x >= start)
                acc.add_invalid(start, None, "not valid UTF-8 text" + (f" (at line {at})" if at != start else ""))
                bad_utf8.clear()
                continue
            obj = {name: row[i] for name, i in index if i < len(row)}
            if chat and "messages" in obj and not _decode_messages_cell(acc, start, obj):
                continue
            acc.check(start, obj, key_from_convo=True)
            n += 1
            if not n & 1023:
                prog.maybe(raw.tell())


def _long_record(line: int) -> str:
    return f"the record on line {line} is longer than {_CSV_FIELD_LIMIT >> 20} MiB; stopped reading here"


def _decode_messages_cell(acc: _Accumulator, line: int, obj: dict) -> bool:
    """Decode a `messages` cell that holds the list as a JSON string (CSV, Parquet), in place.

    Records the record as invalid and returns False when the cell is empty or not JSON."""
    cell = obj["messages"]
    if not cell.strip():
        acc.add_invalid(line, "messages", "empty value: expected a JSON list of messages")
        return False
    try:
        obj["messages"] = orjson.loads(cell)
    except orjson.JSONDecodeError as exc:
        acc.add_invalid(line, "messages", f"invalid JSON: {exc}")
        return False
    return True


def _arrow_messages_ok(pa, typ) -> bool:
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return True
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        return pa.types.is_struct(typ.value_type)
    return False


# Parquet: what the records decode to, known before they are decoded.
#
# A few KB of Parquet can decode to terabytes: a column whose values are all one long dictionary entry
# (each row costs a few bits of run-length encoded index), values that each repeat the one before
# (DELTA_BYTE_ARRAY), or one long value that compresses a thousandfold. The footer gives each column
# chunk's value count and uncompressed size, which is what its values decode to unless they repeat;
# where they may, the longest dictionary entry bounds each value (the dictionary is read alone), and
# where that bound is too loose to tell, the dictionary indices are counted without decoding values.
# A file whose records come to more than a dataset may hold is refused before any is decoded; the
# others are decoded in batches these sizes keep small. The footer can lie; a file that still kills
# its worker is given up after a few attempts (datasets.service.validate).


def _size(n: int) -> str:
    """A byte count for people: 512 bytes, 1.4 KiB, 16.0 GiB."""
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):  # noqa: B007 - the unit the loop stops at is the one shown
        value /= 1024
        if value < 1024:
            break
    return f"{value:.1f} {unit}"


def _row_bytes(arr) -> np.ndarray:
    """What each value of an Arrow array decodes to, as the Parquet checks count it: the bytes of its
    strings (a fixed-width value: its width) plus _VALUE_BYTES for each value, nested values summed per
    row. Computed on Arrow's buffers: no Python object is made, and a dictionary's entries are measured
    once, not once for each row that points to them."""
    import pyarrow as pa

    pc: Any = importlib.import_module("pyarrow.compute")  # its functions are made at import: untyped

    typ, n = arr.type, len(arr)
    if pa.types.is_dictionary(typ):
        entries = _row_bytes(arr.dictionary)
        if not len(entries):
            return np.full(n, _VALUE_BYTES, dtype=np.int64)
        out = entries[arr.indices.fill_null(0).to_numpy(zero_copy_only=False)]
        if arr.null_count:
            out[arr.is_null().to_numpy(zero_copy_only=False)] = _VALUE_BYTES
        return out
    if (
        pa.types.is_string(typ)
        or pa.types.is_large_string(typ)
        or pa.types.is_binary(typ)
        or pa.types.is_large_binary(typ)
        or pa.types.is_string_view(typ)
        or pa.types.is_binary_view(typ)
    ):
        lengths = pc.binary_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
        return lengths.astype(np.int64) + _VALUE_BYTES
    if pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
        values = pc.list_flatten(arr)
        parents = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)
        if len(parents) == len(values):
            return np.bincount(parents, weights=_row_bytes(values), minlength=n).astype(np.int64)
    elif pa.types.is_struct(typ):
        out = np.zeros(n, dtype=np.int64)
        for child in arr.flatten():
            out += _row_bytes(child)
        return out
    else:
        try:
            return np.full(n, max(1, typ.bit_width // 8) + _VALUE_BYTES, dtype=np.int64)
        except ValueError:  # not fixed-width (a map, a union): its buffers, spread evenly
            pass
    return np.full(n, arr.get_total_buffer_size() // max(n, 1) + _VALUE_BYTES, dtype=np.int64)


def _leaf_arrays(arr) -> Iterator:
    """The leaf arrays of an Arrow array, in the order of the Parquet leaf columns it was read from."""
    import pyarrow as pa

    pc: Any = importlib.import_module("pyarrow.compute")  # its functions are made at import: untyped

    typ = arr.type
    if pa.types.is_struct(typ):
        for child in arr.flatten():
            yield from _leaf_arrays(child)
    elif pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
        yield from _leaf_arrays(pc.list_flatten(arr))
    else:
        yield arr


@dataclass
class _Chunk:
    """One column chunk the records need: a leaf column of a wanted column, in one row group."""

    column: str  # the wanted (top-level) column
    path: str  # the leaf column's path in the Parquet schema, e.g. messages.list.element.content
    num_values: int
    uncompressed: int
    width: int  # the bytes of one value of a fixed-width type; 0 for strings
    dictionary: bool  # it has a dictionary page: its values may repeat one entry again and again
    delta: bool  # DELTA_BYTE_ARRAY: each value may repeat the one before
    longest: int  # the most one of its values decodes to (until its dictionary is read: its whole size)

    @property
    def repeats(self) -> bool:
        return not self.width and (self.dictionary or self.delta)

    @property
    def as_stored(self) -> bool:
        """Arrow can hand its values over as dictionary indices."""
        return self.repeats and not self.delta

    def bound(self, as_stored: bool = False) -> int:
        """At most what it decodes to (as _row_bytes counts), or with ``as_stored`` what Arrow holds
        when its dictionary is kept as stored."""
        if self.width:
            return self.num_values * (self.width + _VALUE_BYTES)
        if as_stored and self.as_stored:
            return self.uncompressed + self.num_values * 4
        repeated = self.num_values * self.longest if self.repeats else 0
        return self.uncompressed + self.num_values * _VALUE_BYTES + repeated


@dataclass
class _RowGroup:
    index: int
    rows: int
    chunks: list[_Chunk]

    def batch_rows(self, most: int, as_stored: bool = False) -> int:
        """Rows per batch so that a batch of rows as large as the bounds allow decodes to about
        _PARQUET_BATCH_BYTES (of average rows, where values are stored as they decode)."""
        bound = sum(c.bound(as_stored) for c in self.chunks)
        return max(1, min(most, _PARQUET_BATCH_BYTES * self.rows // max(bound, 1)))


def _parquet_row_groups(pf, path: str, wanted: list[str]) -> list[_RowGroup]:
    """The row groups and, from the footer, the column chunks of the wanted columns, with the longest
    entry of each dictionary (read alone)."""
    md, schema = pf.metadata, pf.schema
    groups = []
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        chunks = []
        for j in range(rg.num_columns):
            cc = rg.column(j)
            leaf = cc.path_in_schema
            column = next((c for c in wanted if leaf == c or leaf.startswith(c + ".")), None)
            if column is None:
                continue
            physical = cc.physical_type
            width = schema.column(j).length if physical == "FIXED_LEN_BYTE_ARRAY" else _FIXED_WIDTH.get(physical, 0)
            encodings = set(cc.encodings)
            size = max(0, cc.total_uncompressed_size)
            chunks.append(
                _Chunk(
                    column,
                    leaf,
                    max(0, cc.num_values),
                    size,
                    max(0, width or 0),
                    dictionary=cc.has_dictionary_page or bool(encodings & _DICTIONARY_ENCODINGS),
                    delta="DELTA_BYTE_ARRAY" in encodings,
                    longest=size,
                )
            )
        groups.append(_RowGroup(i, max(0, rg.num_rows), chunks))
    stored = list(dict.fromkeys(c.path for g in groups for c in g.chunks if c.as_stored))
    if stored:
        import pyarrow.parquet as pq

        try:
            reader = pq.ParquetFile(path, metadata=md, read_dictionary=stored)
        except Exception:  # noqa: BLE001 - unreadable: the scan reports it; the bounds stay the chunks' sizes
            return groups
        for group in groups:
            _read_dictionaries(reader, group)
    return groups


def _read_dictionaries(reader, group: _RowGroup) -> None:
    """Each dictionary's longest entry, as its chunk's ``longest``: the row group's first row is read with
    the dictionaries kept as stored, which decodes each dictionary page whole (no larger than its chunk)
    and no row's values. A dictionary not seen so keeps the chunk's size as its bound."""
    import pyarrow as pa

    pc: Any = importlib.import_module("pyarrow.compute")  # its functions are made at import: untyped

    targets = [c for c in group.chunks if c.as_stored]
    if not targets or not group.rows:
        return
    columns = list(dict.fromkeys(c.column for c in targets))
    try:
        batch = next(reader.iter_batches(batch_size=1, row_groups=[group.index], columns=columns), None)
    except Exception:  # noqa: BLE001 - unreadable: the scan reports it
        return
    if batch is None:
        return
    for name in columns:
        chunks = [c for c in group.chunks if c.column == name]
        leaves = list(_leaf_arrays(batch.column(name)))
        if len(leaves) != len(chunks):
            continue
        for chunk, leaf in zip(chunks, leaves, strict=True):
            if chunk.as_stored and pa.types.is_dictionary(leaf.type) and len(leaf.dictionary):
                chunk.longest = int(pc.max(pc.binary_length(leaf.dictionary)).as_py() or 0)


def _count_parquet(pf, path: str, group: _RowGroup, columns: list[str], stop_at: int) -> dict[str, int]:
    """What ``columns`` of a row group decode to (as _row_bytes counts), counted batch by batch on Arrow's
    buffers until the sum passes ``stop_at``. Dictionary-encoded chunks are read as their indices, which
    is fast and small; a chunk that also holds values outside its dictionary (a writer's fallback when
    the dictionary grew too large) makes Arrow grow the dictionary batch by batch, so the row group is
    then counted again, decoded, in the small batches its bounds give."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    stored = [c.path for c in group.chunks if c.column in columns and c.as_stored]

    def count(read_dictionary: list[str], batch_rows: int) -> dict[str, int] | None:
        totals = dict.fromkeys(columns, 0)
        seen: dict[str, list[int]] = {}
        try:
            reader = pq.ParquetFile(path, metadata=pf.metadata, read_dictionary=read_dictionary or None)
            for batch in reader.iter_batches(batch_size=batch_rows, row_groups=[group.index], columns=columns):
                for name in columns:
                    arr = batch.column(name)
                    if read_dictionary:
                        sizes = [len(a.dictionary) for a in _leaf_arrays(arr) if pa.types.is_dictionary(a.type)]
                        if seen.setdefault(name, sizes) != sizes:
                            return None
                    totals[name] += int(_row_bytes(arr).sum())
                if sum(totals.values()) > stop_at:
                    break
        except Exception:  # noqa: BLE001 - unreadable pages: the scan reports them
            pass
        return totals

    counted = count(stored, group.batch_rows(_PARQUET_COUNT_BATCH, as_stored=True)) if stored else None
    return counted if counted is not None else count([], group.batch_rows(_PARQUET_BATCH)) or {}


def _check_parquet_size(pf, path: str, filename: str, groups: list[_RowGroup], max_bytes: int, file_bytes: int) -> None:
    """Refuse a file whose records come to more than ``max_bytes``, before any is decoded: row group by
    row group, each column's bound from the footer and dictionaries, counted exactly where the bound is
    too loose to tell (values that repeat)."""
    total = 0
    for group in groups:
        sizes: dict[str, int] = {}
        for chunk in group.chunks:
            sizes[chunk.column] = sizes.get(chunk.column, 0) + chunk.bound()
        if total + sum(sizes.values()) > max_bytes:
            loose = [name for name in sizes if any(c.repeats for c in group.chunks if c.column == name)]
            if loose:
                rest = sum(size for name, size in sizes.items() if name not in loose)
                sizes.update(_count_parquet(pf, path, group, loose, max_bytes - total - rest))
        for name, size in sizes.items():
            total += size
            if total > max_bytes:
                raise DatasetTooLargeError(
                    f"{filename}: too large once decoded: by row group {group.index}, column '{name}' "
                    f"the records come to {_size(total)}, more than the {_size(max_bytes)} a dataset may hold "
                    f"(TUNEDECK_MAX_UPLOAD_BYTES); the file itself is {_size(file_bytes)}"
                )


def _scan_parquet(
    path: str, filename: str, acc: _Accumulator, prog: _Progress, total: int, max_bytes: int | None = None
) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow is a dependency
        raise DatasetFormatError(f"{filename}: Parquet support needs pyarrow") from exc
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # ArrowInvalid, OSError ...
        raise DatasetFormatError(f"{filename}: not a readable Parquet file: {exc}") from exc
    schema = pf.schema_arrow
    names = list(schema.names)
    if acc.fmt is None:
        acc.fmt = _format_from_keys(names, filename, "Parquet columns")
    missing = [c for c in _REQUIRED[acc.fmt] if c not in names]
    if missing:
        acc.file_error(
            0,
            f"missing required column(s) for format '{acc.fmt}': {', '.join(missing)} "
            f"(the file has: {clip(', '.join(names)) or 'nothing'})",
        )
        return
    chat = acc.fmt == "chat"
    if chat and not _arrow_messages_ok(pa, schema.field("messages").type):
        acc.file_error(
            0,
            f"column 'messages' has type {schema.field('messages').type}; expected "
            "list<struct<role: string, content: string>> or a JSON string",
        )
        return
    wanted = [c for c in _REQUIRED[acc.fmt] + _OPTIONAL.get(acc.fmt, ()) if c in names]
    groups = _parquet_row_groups(pf, path, wanted)
    if max_bytes is not None:
        _check_parquet_size(pf, path, filename, groups, max_bytes, total)
    num_rows = pf.metadata.num_rows or 0
    row = 0
    decoded = 0  # what the footer promised is checked again as the batches come (it can lie)
    for batch_rows, run in itertools.groupby(groups, key=lambda g: g.batch_rows(_PARQUET_BATCH)):
        batches = pf.iter_batches(batch_size=batch_rows, row_groups=[g.index for g in run], columns=wanted)
        while True:
            try:
                batch = next(batches, None)
            except Exception as exc:  # corrupt pages etc.
                acc.file_error(row + 1, f"cannot read the Parquet file past row {row}: {exc}")
                return
            if batch is None:
                break
            sizes = {name: _row_bytes(batch.column(name)) for name in wanted}
            row_sizes = sum(sizes.values(), np.zeros(batch.num_rows, dtype=np.int64))
            decoded += int(row_sizes.sum())
            if max_bytes is not None and decoded > max_bytes:
                acc.file_error(
                    row + 1,
                    f"the records come to more than the {_size(max_bytes)} a dataset may hold "
                    f"(TUNEDECK_MAX_UPLOAD_BYTES) by row {row + batch.num_rows}; stopped reading here",
                )
                return
            row = _parquet_records(acc, batch, sizes, row_sizes.tolist(), row, chat)
            if num_rows:
                prog.maybe(total * row // num_rows)


def _parquet_records(acc: _Accumulator, batch, sizes: dict, row_sizes: list[int], row: int, chat: bool) -> int:
    """Check a batch's records, made into Python objects a slice of at most _PARQUET_SLICE_BYTES at a
    time; a record over _MAX_LINE is reported, never made. Returns the last row number."""
    n, k = len(row_sizes), 0
    while k < n:
        if row_sizes[k] > _MAX_LINE:
            row += 1
            field_name = max(sizes, key=lambda name: sizes[name][k])
            acc.add_invalid(row, field_name, f"record too long: more than {_MAX_LINE >> 20} MiB")
            k += 1
            continue
        end, used = k, 0
        while end < n and row_sizes[end] <= _MAX_LINE and (end == k or used + row_sizes[end] <= _PARQUET_SLICE_BYTES):
            used += row_sizes[end]
            end += 1
        for rec in batch.slice(k, end - k).to_pylist():
            row += 1
            # A null is an absent value (Parquet columns and structs always carry every key).
            obj = {key: v for key, v in rec.items() if v is not None}
            if chat and "messages" in obj:
                msgs = obj["messages"]
                if type(msgs) is str:
                    if not _decode_messages_cell(acc, row, obj):
                        continue
                elif type(msgs) is list:
                    obj["messages"] = [
                        {key: v for key, v in m.items() if v is not None} if type(m) is dict else m for m in msgs
                    ]
            acc.check(row, obj, key_from_convo=True)
        k = end
    return row


# ---------------------------------------------------------------------------------------------


def _resolve_kind(path: str, filename: str, file_type: str | None, fmt: str | None) -> tuple[str, str | None]:
    """Check the overrides, then detect what they leave open: the file type from the name and head,
    and for JSONL the format from the first record (None when the file has no records). CSV and
    Parquet formats are detected by their scanners, from the header."""
    if file_type is not None and file_type not in FILE_TYPES:
        raise DatasetFormatError(
            f"{filename}: unknown file type {echo(file_type)}; expected one of {', '.join(FILE_TYPES)}"
        )
    if fmt is not None and fmt not in FORMATS:
        raise DatasetFormatError(f"{filename}: unknown format {echo(fmt)}; expected one of {', '.join(FORMATS)}")
    if file_type is None:
        with open(path, "rb") as f:
            file_type = detect_file_type(filename, f.read(_HEAD))
    if file_type == "jsonl" and fmt is None:
        fmt = _detect_jsonl_format(path, filename)
    return file_type, fmt


def validate_file(
    path: str | os.PathLike,
    filename: str,
    *,
    file_type: str | None = None,
    fmt: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    max_bytes: int | None = None,
) -> ValidationReport:
    """Validate a dataset file in one streaming pass and return the report.

    ``file_type`` / ``fmt`` None means auto-detect. Raises DatasetFormatError when either cannot be
    determined or an unknown value is given, and DatasetTooLargeError (one) when a Parquet file's records
    would decode to more than ``max_bytes`` (text, plus a few bytes a value: about their size as JSON
    Lines); every other problem is reported in the result.
    ``progress(done_bytes, total_bytes)`` is called at most every 0.25 s and once at the end.
    """
    path = os.fspath(path)
    total = os.path.getsize(path)
    file_type, fmt = _resolve_kind(path, filename, file_type, fmt)
    acc = _Accumulator(fmt)
    prog = _Progress(progress, total)
    if file_type == "jsonl":
        if fmt is not None:
            _scan_jsonl(path, acc, prog)
    elif file_type == "csv":
        _scan_csv(path, filename, acc, prog)
    else:
        _scan_parquet(path, filename, acc, prog, total, max_bytes)

    if acc.rows == 0 and acc.error_count == 0:
        acc.file_error(0, "the file has no records")
    rows, valid_rows = acc.rows, len(acc.packed)
    stats = acc.stats()
    acc.packed = array("q")  # free the lengths before the duplicate pass needs its sorted copy
    duplicates, duplicate_count = acc.duplicates()
    report = ValidationReport(
        file_type=file_type,
        format=acc.fmt,
        rows=rows,
        valid_rows=valid_rows,
        errors=acc.errors,
        error_count=acc.error_count,
        duplicates=duplicates,
        duplicate_count=duplicate_count,
        stats=stats,
        preview=acc.preview,
    )
    prog.final()
    return report


# ---------------------------------------------------------------------------------------------
# Reading the valid records back (the training worker's input)


class _Stopped(Exception):
    """The consumer of iter_conversations went away; the producer thread stops."""


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_ITER_DONE = object()
_ITER_QUEUE = 256  # conversations buffered between the scanning thread and the consumer


def _conversation(convo: tuple) -> list[dict]:
    return [{"role": role, "content": content} for role, content in convo]


def _iter_jsonl(path: str, fmt: str) -> Iterator[tuple[int, list[dict]]]:
    """The valid records of a JSONL file and their line numbers, with the same per-record checks as the
    validator's slow path."""
    check = _CHECK[fmt]
    with open(path, "rb", buffering=_CHUNK) as f:
        first = True
        for number, line in enumerate(iter(functools.partial(f.readline, _MAX_LINE), b""), start=1):
            if first and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            first = False
            if len(line) >= _MAX_LINE and not line.endswith(b"\n"):  # too long: invalid, skipped whole
                while True:
                    piece = f.readline(_MAX_LINE)
                    if not piece or piece.endswith(b"\n"):
                        break
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # blank line or invalid JSON
            if type(obj) is not dict:
                continue
            try:
                _, convo = check(obj)
            except _RecordError:
                continue
            yield number, _conversation(convo)


def _iter_scanned(scan: Callable[[_Accumulator], None], fmt: str | None) -> Iterator[tuple[int, list[dict]]]:
    """Run a CSV/Parquet scanner in a thread with an accumulator that hands each valid record's
    conversation over a bounded queue: the scanners' parsing is reused as is, memory stays flat."""
    q: queue.Queue = queue.Queue(maxsize=_ITER_QUEUE)
    stop = threading.Event()

    def put(item) -> None:
        while True:
            if stop.is_set():
                raise _Stopped
            try:
                q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    class _Sink(_Accumulator):
        def add_valid(self, line: int, packed: int, convo: tuple, key: int | None) -> None:
            put((line, _conversation(convo)))

        def add_invalid(self, line: int, field_name: str | None, message: str) -> None:
            pass

        def file_error(self, line: int, message: str) -> None:
            pass

    def run() -> None:
        try:
            scan(_Sink(fmt))
            put(_ITER_DONE)
        except _Stopped:
            pass
        except BaseException as exc:  # handed to the consumer
            try:
                put(_Failed(exc))
            except _Stopped:
                pass

    thread = threading.Thread(target=run, name="iter-conversations", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _ITER_DONE:
                return
            if isinstance(item, _Failed):
                raise item.exc
            yield item
    finally:
        stop.set()
        thread.join()


def iter_conversations(
    path: str | os.PathLike,
    filename: str,
    *,
    file_type: str | None,
    fmt: str | None,
) -> Iterator[list[dict]]:
    """The conversations of :func:`iter_numbered_conversations`, without their line numbers."""
    return (messages for _, messages in iter_numbered_conversations(path, filename, file_type=file_type, fmt=fmt))


def iter_numbered_conversations(
    path: str | os.PathLike,
    filename: str,
    *,
    file_type: str | None,
    fmt: str | None,
) -> Iterator[tuple[int, list[dict]]]:
    """Stream the line number (as the validator reports it) and normalised conversation of every VALID
    record of a dataset file, in file order.

    Each item is ``[{"role", "content"}, ...]``, normalised exactly as :func:`validate_file` does:
    chat messages as given (system/user/assistant, extra keys such as ``weight`` dropped);
    prompt/completion -> user/assistant; alpaca -> user (instruction + "\\n\\n" + input, or the
    instruction alone) / assistant; text -> ``[{"role": "text", "content": ...}]``; preference -> the
    prompt's turns, the chosen answer (assistant), the rejected one (role ``rejected``). Invalid records
    are skipped. ``file_type`` / ``fmt`` None means auto-detect (DatasetFormatError as in validate_file).
    """
    path = os.fspath(path)
    file_type, fmt = _resolve_kind(path, filename, file_type, fmt)
    if file_type == "jsonl":
        if fmt is None:  # no records
            return iter(())
        return _iter_jsonl(path, fmt)
    total = os.path.getsize(path)
    progress = _Progress(None, total)
    if file_type == "csv":
        return _iter_scanned(lambda acc: _scan_csv(path, filename, acc, progress), fmt)
    return _iter_scanned(lambda acc: _scan_parquet(path, filename, acc, progress, total), fmt)
