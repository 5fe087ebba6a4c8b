from datetime import datetime

from sqlmodel import Field, SQLModel

from app.core.db import utcnow


class UserBase(SQLModel):
    username: str = Field(min_length=1, max_length=64, schema_extra={"pattern": r"^[A-Za-z0-9_.@-]+$"})
    is_admin: bool = False


class UserCreate(UserBase):
    password: str = Field(min_length=8, max_length=256)


class User(UserBase, table=True):
    __tablename__ = "users"  # pyright: ignore[reportAssignmentType]
    id: int | None = Field(default=None, primary_key=True)
    username: str = Field(max_length=64, unique=True, index=True)
    hashed_password: str
    created_at: datetime = Field(default_factory=utcnow)


class UserPublic(UserBase):
    id: int
    created_at: datetime


class ApiTokenCreate(SQLModel):
    name: str = Field(min_length=1, max_length=100)


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


class ApiTokenPublic(SQLModel):
    id: int
    name: str
    prefix: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


class ApiTokenCreated(ApiTokenPublic):
    token: str = Field(description="The secret, shown this once only")


class UsersPublic(SQLModel):
    data: list[UserPublic]
    count: int


class ApiTokensPublic(SQLModel):
    data: list[ApiTokenPublic]
    count: int
