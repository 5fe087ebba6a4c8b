from datetime import datetime

from sqlalchemy import false
from sqlmodel import Field, SQLModel

from app.core.db import utcnow
from app.core.schemas import Schema

MIN_PASSWORD, MAX_PASSWORD = 8, 256
MAX_TOKEN_DAYS = 365


class UserBase(Schema):
    username: str = Field(min_length=1, max_length=64, schema_extra={"pattern": r"^[A-Za-z0-9_.@-]+$"})
    is_admin: bool = False


class UserCreate(UserBase):
    password: str = Field(min_length=MIN_PASSWORD, max_length=MAX_PASSWORD)


class UserLimits(SQLModel):
    """A user's own limits, set by an admin; null: the setting's (TUNEDECK_MAX_LIVE_ENDPOINTS,
    TUNEDECK_MAX_ACTIVE_RUNS)."""

    max_live_endpoints: int | None = Field(
        default=None, ge=0, le=100_000, description="live endpoints (pending, starting, ready, stopping) at most"
    )
    max_active_runs: int | None = Field(
        default=None, ge=0, le=100_000, description="active runs (validating files, queued, running, paused) at most"
    )


class UserUpdate(UserLimits, Schema):
    """What an admin changes on a user (PATCH /api/v1/users/{id}): only the fields sent (a null limit: back
    to the setting's default)."""

    model_config = {"extra": "forbid"}  # a misspelt field is an error, not a silent no-op
    disabled: bool | None = Field(
        default=None,
        description="true: the user can no longer log in, and their API tokens, sessions and live streams "
        "stop at once; false: enabled again (their tokens work again; old sessions stay ended)",
    )


class User(UserBase, UserLimits, table=True):
    __tablename__ = "users"  # pyright: ignore[reportAssignmentType]
    id: int | None = Field(default=None, primary_key=True)
    username: str = Field(max_length=64, unique=True, index=True)
    hashed_password: str
    created_at: datetime = Field(default_factory=utcnow)
    disabled: bool = Field(default=False, sa_column_kwargs={"server_default": false()})
    # In each session cookie; bumped to end every session at once (password change, disabled).
    session_version: int = Field(default=0, sa_column_kwargs={"server_default": "0"})


class UserPublic(UserBase, UserLimits):
    id: int
    created_at: datetime
    disabled: bool


class LoginFailure(SQLModel, table=True):
    """A failed login, kept for the limits' window (TUNEDECK_LOGIN_WINDOW_SECONDS). In the database, so
    that every web process counts the same failures."""

    __tablename__ = "login_failures"  # pyright: ignore[reportAssignmentType]
    id: int | None = Field(default=None, primary_key=True)
    username: str = Field(max_length=64, index=True)  # as typed (cut to 64): unknown names count too
    address: str = Field(max_length=64, index=True)
    at: datetime = Field(default_factory=utcnow, index=True)


class ApiTokenCreate(Schema):
    name: str = Field(min_length=1, max_length=100)
    expires_in_days: int | None = Field(
        default=None,
        ge=1,
        le=MAX_TOKEN_DAYS,
        description="the token stops working this many days from now; unset: it works until revoked",
    )


class ApiToken(SQLModel, table=True):
    __tablename__ = "api_tokens"  # pyright: ignore[reportAssignmentType]
    id: int | None = Field(default=None, primary_key=True)
    user_id: int = Field(foreign_key="users.id", index=True, ondelete="CASCADE")
    name: str = Field(max_length=100)
    token_hash: str = Field(max_length=64, unique=True, index=True)
    prefix: str = Field(max_length=12)
    created_at: datetime = Field(default_factory=utcnow)
    last_used_at: datetime | None = None
    revoked_at: datetime | None = None
    expires_at: datetime | None = None


class ApiTokenPublic(SQLModel):
    id: int
    name: str
    prefix: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None
    expires_at: datetime | None


class ApiTokenCreated(ApiTokenPublic):
    token: str = Field(description="The secret, shown this once only")


class UsersPublic(SQLModel):
    data: list[UserPublic]
    count: int


class ApiTokensPublic(SQLModel):
    data: list[ApiTokenPublic]
    count: int
