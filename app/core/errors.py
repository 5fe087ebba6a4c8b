"""The API's error answers, in one shape wherever they come from."""

from fastapi import HTTPException, status


def unprocessable(message: str, *loc: str | int) -> HTTPException:
    """422 in FastAPI's own validation shape, naming the body field that is wrong (``loc``)."""
    return HTTPException(
        status.HTTP_422_UNPROCESSABLE_CONTENT, [{"loc": ["body", *loc], "msg": message, "type": "value_error"}]
    )


def conflict(message: str) -> HTTPException:
    return HTTPException(status.HTTP_409_CONFLICT, message)
