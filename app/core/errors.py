"""The API's error answers, in one shape wherever they come from, and the error services raise."""

import json
from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi import HTTPException, status
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from app.core.echo import ECHO_CHARS, clip

T = TypeVar("T")


class FieldError(ValueError):
    """A service refused: ``field`` names what is wrong; ``conflict`` when it is the object's state
    (409), ``missing`` when the field names an object the caller has not got (404), else the request (422)."""

    def __init__(self, field: str, message: str, *, conflict: bool = False, missing: bool = False) -> None:
        super().__init__(message)
        self.field = field
        self.conflict = conflict
        self.missing = missing


def answer(exc: FieldError) -> HTTPException:
    """The HTTP answer to a service's refusal."""
    if exc.missing:
        return HTTPException(status.HTTP_404_NOT_FOUND, str(exc))
    return conflict(str(exc)) if exc.conflict else unprocessable(str(exc), exc.field)


def unprocessable(message: str, *loc: str | int, where: str = "body") -> HTTPException:
    """422 in FastAPI's own validation shape, naming the field that is wrong (``loc``) of the body, or
    of the ``query``."""
    return HTTPException(
        status.HTTP_422_UNPROCESSABLE_CONTENT, [{"loc": [where, *loc], "msg": message, "type": "value_error"}]
    )


def conflict(message: str) -> HTTPException:
    return HTTPException(status.HTTP_409_CONFLICT, message)


def not_found(what: str, key: str | int) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"{what} {clip(str(key))} not found")


def found(row: T | None, what: str, key: str | int) -> T:
    """The row looked up, or a 404 naming what was not found."""
    if row is None:
        raise not_found(what, key)
    return row


def openai_error(status_code: int, message: str, param: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape, for the `/v1` APIs (the OpenAI SDK reads `error.message`)."""
    kind = "invalid_request_error" if status_code < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code)


LISTED_ERRORS = 20  # a body of a million bad items has a million errors: the first ones, then a count


def validation_errors(errors: Sequence[Any]) -> list[dict]:
    """FastAPI's 422 ``detail`` for these validation errors, with the ``input`` each one quotes cut to a short
    prefix (a string to its first ECHO_CHARS characters and "…", anything else to its JSON, cut the same
    when longer), and past the first LISTED_ERRORS errors, only how many more there are."""
    detail = jsonable_encoder(errors[:LISTED_ERRORS])
    if len(errors) > LISTED_ERRORS:
        more = len(errors) - LISTED_ERRORS
        detail.append({"type": "too_many_errors", "loc": ["body"], "msg": f"and {more} more errors", "input": None})
    for error in detail:
        value = error.get("input")
        if isinstance(value, str):
            error["input"] = clip(value)
        elif value is not None and len(text := json.dumps(value)) > ECHO_CHARS:
            error["input"] = clip(text)
    return detail
