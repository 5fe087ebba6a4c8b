"""What every request schema shares: finite numbers only, and bounds that fit the database.

Every schema a route reads a body into derives from `Schema` (tests/test_schemas.py checks it), so a
number is finite however it is written: JSON's `NaN` and `Infinity` tokens, and the strings "inf" or
"nan" that pydantic would otherwise read as floats, are a 422 naming the field. NUL characters, which
PostgreSQL cannot store or compare, are refused for every route in `core/routing.py`.
"""

from typing import Annotated

from fastapi import Path, Query
from sqlmodel import SQLModel

INT32_MAX = 2**31 - 1  # PostgreSQL's INTEGER: ids, steps, counts
ID_LENGTH = 32  # the id columns (``new_id``: a prefix and 20 hex digits)
NAME_LENGTH = 64  # pool and base-model names
NUL = "\x00"  # PostgreSQL can neither store nor compare text holding it


class Schema(SQLModel):
    model_config = {"allow_inf_nan": False}


Offset = Annotated[int, Query(ge=0, le=INT32_MAX)]
RowId = Annotated[int, Path(ge=1, le=INT32_MAX)]  # an integer primary key in a URL
