"""Users and API tokens (/api/v1/users, /api/v1/tokens)."""

from fastapi import APIRouter, HTTPException, status
from sqlmodel import col, select

from app.auth import service
from app.auth.models import (
    ApiTokenCreate,
    ApiTokenCreated,
    ApiTokenPublic,
    ApiTokensPublic,
    User,
    UserCreate,
    UserPublic,
    UsersPublic,
    UserUpdate,
)
from app.core import errors
from app.core.deps import AdminUser, CurrentUser, SessionDep
from app.core.routing import Route
from app.core.schemas import RowId

router = APIRouter(route_class=Route, prefix="/api/v1", tags=["auth"])


@router.get("/users/me", response_model=UserPublic)
def read_me(user: CurrentUser) -> User:
    return user


@router.get("/users", response_model=UsersPublic)
def list_users(session: SessionDep, _: AdminUser) -> UsersPublic:
    users = session.exec(select(User).order_by(col(User.id))).all()
    return UsersPublic(data=[UserPublic.model_validate(u) for u in users], count=len(users))


@router.post("/users", response_model=UserPublic, status_code=status.HTTP_201_CREATED)
def create_user(data: UserCreate, session: SessionDep, _: AdminUser) -> User:
    try:
        return service.create_user(session, data)
    except service.UsernameTaken as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc


@router.patch("/users/{user_id}", response_model=UserPublic)
def update_user(user_id: RowId, data: UserUpdate, session: SessionDep, admin: AdminUser) -> User:
    """Disable (`{"disabled": true}`) or enable a user, or set their limits (`max_live_endpoints`,
    `max_active_runs`; null: the default). A disabled user cannot log in, and their API tokens, dashboard
    sessions and live streams stop at once."""
    user = errors.found(session.get(User, user_id), "user", user_id)
    try:
        return service.update_user(session, admin, user, data)
    except errors.FieldError as exc:
        raise errors.answer(exc) from exc


@router.get("/tokens", response_model=ApiTokensPublic)
def list_tokens(session: SessionDep, user: CurrentUser) -> ApiTokensPublic:
    tokens = service.list_tokens(session, user)
    return ApiTokensPublic(data=[ApiTokenPublic.model_validate(t) for t in tokens], count=len(tokens))


@router.post("/tokens", response_model=ApiTokenCreated, status_code=status.HTTP_201_CREATED)
def create_token(data: ApiTokenCreate, session: SessionDep, user: CurrentUser) -> ApiTokenCreated:
    """Mint a token, for good or for `expires_in_days`. Its secret is in this response only; Tunedeck
    keeps just a hash."""
    token, secret = service.create_token(session, user, data.name, expires_in_days=data.expires_in_days)
    return ApiTokenCreated(**token.model_dump(), token=secret)


@router.delete("/tokens/{token_id}", response_model=ApiTokenPublic)
def revoke_token(token_id: RowId, session: SessionDep, user: CurrentUser):
    return errors.found(service.revoke_token(session, user, token_id), "token", token_id)
