"""Streaming multipart/form-data receiver.

Request bodies are parsed as they arrive: file parts go straight to a temporary file next to their
final place in storage, hashed on the way, so an upload never sits whole in memory and an
interrupted one leaves nothing behind (the caller renames the temp file only once it succeeds).
"""

import hashlib
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from fastapi import HTTPException, Request, status
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

if TYPE_CHECKING:  # the library declares it for type checkers only
    from python_multipart.multipart import MultipartCallbacks

MAX_FIELD_BYTES = 64 * 1024


@dataclass
class ReceivedFile:
    field: str
    filename: str
    path: Path
    size: int = 0
    sha256: str = ""


@dataclass
class ReceivedForm:
    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, ReceivedFile] = field(default_factory=dict)

    def discard(self) -> None:
        for f in self.files.values():
            f.path.unlink(missing_ok=True)


def _bad_request(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_400_BAD_REQUEST, detail)


def _too_large(limit: int) -> HTTPException:
    return HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"upload exceeds the limit of {limit} bytes")


class _Receiver:
    def __init__(self, tmp_dir: Path, max_bytes: int) -> None:
        self.tmp_dir, self.max_bytes = tmp_dir, max_bytes
        self.form = ReceivedForm()
        self.finished = False
        self.error: HTTPException | None = None
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._headers: dict[str, bytes] = {}
        self._name = ""
        self._file: ReceivedFile | None = None
        self._fh: BinaryIO | None = None  # open while a file part is being received (``_file``)
        self._digest = hashlib.sha256()
        self._value = bytearray()

    def callbacks(self) -> "MultipartCallbacks":
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda d, s, e: self._header_field.extend(d[s:e]),
            "on_header_value": lambda d, s, e: self._header_value.extend(d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def _part_begin(self) -> None:
        self._headers = {}
        self._file = None
        self._value = bytearray()

    def _header_end(self) -> None:
        self._headers[self._header_field.decode("latin-1").lower()] = bytes(self._header_value)
        self._header_field.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        disposition, options = parse_options_header(self._headers.get("content-disposition", b""))
        if disposition != b"form-data" or b"name" not in options:
            raise _bad_request("each multipart part needs 'Content-Disposition: form-data; name=...'")
        self._name = options[b"name"].decode("utf-8", "replace")
        if b"filename" in options:
            filename = os.path.basename(options[b"filename"].decode("utf-8", "replace").replace("\\", "/"))
            if not filename:
                raise _bad_request(f"form field '{self._name}': the file has no name")
            if self._name in self.form.files:
                raise _bad_request(f"form field '{self._name}' holds more than one file")
            path = self.tmp_dir / f".upload-{uuid.uuid4().hex}.part"
            self._file = self.form.files[self._name] = ReceivedFile(self._name, filename, path)
            self._fh = open(path, "wb")  # noqa: SIM115 - closed in _part_end or close()
            self._digest = hashlib.sha256()

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._file is None:
            self._value.extend(data[start:end])
            if len(self._value) > MAX_FIELD_BYTES:
                raise _bad_request(f"form field '{self._name}' is longer than {MAX_FIELD_BYTES} bytes")
            return
        assert self._fh is not None, "a file part has its temporary file open"
        chunk = data[start:end]
        self._file.size += len(chunk)
        if self._file.size > self.max_bytes:
            raise _too_large(self.max_bytes)
        self._digest.update(chunk)
        self._fh.write(chunk)

    def _part_end(self) -> None:
        if self._file is not None:
            assert self._fh is not None, "a file part has its temporary file open"
            self._fh.close()
            self._fh = None
            self._file.sha256 = self._digest.hexdigest()
        else:
            self.form.fields[self._name] = self._value.decode("utf-8", "replace")

    def _end(self) -> None:
        self.finished = True

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


async def receive_multipart(request: Request, tmp_dir: Path, max_bytes: int) -> ReceivedForm:
    """Read a multipart body; file parts land in `tmp_dir` as temporary files the caller owns.

    On any failure (bad body, size limit, client gone) every temporary file is removed.
    """
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or b"boundary" not in options:
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, "send the file as multipart/form-data")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes + MAX_FIELD_BYTES:
        raise _too_large(max_bytes)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    receiver = _Receiver(tmp_dir, max_bytes)
    parser = MultipartParser(options[b"boundary"], receiver.callbacks())
    try:
        async for chunk in request.stream():
            if chunk:
                parser.write(chunk)
        parser.finalize()
        if not receiver.finished:
            raise _bad_request("the multipart body ended early: the upload is incomplete")
    except MultipartParseError as exc:
        receiver.close()
        receiver.form.discard()
        raise _bad_request(f"malformed multipart body: {exc}") from exc
    except BaseException:
        receiver.close()
        receiver.form.discard()
        raise
    return receiver.form
