"""How an error message quotes what a user sent: a short prefix of it. A field value, a file's header or a
record's field can be as long as a request body or a file allows, and an error message that quoted it
whole would carry all of it into the answer, and into the database where errors are kept. Stdlib only:
the dataset validator imports it."""

import reprlib

ECHO_CHARS = 200  # what an error message shows of a value the user sent
STORED_CHARS = 2000  # the most of one error message that is kept

_repr = reprlib.Repr()  # containers shown to a few items, strings and others to ECHO_CHARS
_repr.maxlevel, _repr.maxstring, _repr.maxother = 2, ECHO_CHARS, ECHO_CHARS
_repr.maxdict = _repr.maxlist = _repr.maxtuple = _repr.maxset = 8


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """``text``, or its first ``limit`` characters and "…" when it is longer."""
    return text if len(text) <= limit else text[:limit] + "…"


def echo(value: object) -> str:
    """``value`` as an error message quotes it: its repr (a string's first ECHO_CHARS characters, then "…")."""
    if isinstance(value, str):
        return repr(value) if len(value) <= ECHO_CHARS else repr(value[:ECHO_CHARS]) + "…"
    return clip(_repr.repr(value))
