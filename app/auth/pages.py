"""Login, logout, the password page, the API-token settings page, and the admins' users page."""

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse
from sqlmodel import col, select

from app.auth import service
from app.auth.models import MAX_PASSWORD, MAX_TOKEN_DAYS, MIN_PASSWORD, User, UserUpdate
from app.core.db import utcnow
from app.core.deps import CsrfChecked, SessionDep, WebUser, log_in
from app.core.errors import FieldError
from app.core.routing import Route
from app.core.schemas import RowId
from app.core.templating import render

router = APIRouter(route_class=Route, include_in_schema=False)


def _safe_next(next_: str) -> str:
    return next_ if next_.startswith("/") and not next_.startswith("//") else "/"


def client_address(request: Request) -> str:
    """Who is asking, for the per-address login limit: the peer's address, or the one a proxy on this
    host (uvicorn's --forwarded-allow-ips, 127.0.0.1 by default) put in X-Forwarded-For."""
    return request.client.host if request.client else "unknown"


@router.get("/login")
def login_page(request: Request, next: str = "/"):
    return render(request, "login.html", next=_safe_next(next), error=None)


@router.post("/login", dependencies=[CsrfChecked])
async def login(
    request: Request,
    username: Annotated[str, Form()],
    password: Annotated[str, Form()],
    next: Annotated[str, Form()] = "/",
):
    # Async: the password check runs in threads of its own, a few at a time (app.core.security).
    def refused(error: str, status_code: int):
        return render(request, "login.html", next=_safe_next(next), error=error, status_code=status_code)

    try:
        user = await service.login(username, password, client_address(request))
    except service.LoginThrottled as exc:
        response = refused(str(exc), 429)
        response.headers["Retry-After"] = str(exc.retry_after)
        return response
    except service.AccountDisabled as exc:
        return refused(str(exc), 403)
    if user is None:
        return refused("Wrong username or password.", 401)
    log_in(request, user)
    return RedirectResponse(_safe_next(next), status_code=303)


@router.post("/logout", dependencies=[CsrfChecked])
def logout(request: Request):
    request.session.clear()
    return RedirectResponse("/login", status_code=303)


# --- password ------------------------------------------------------------------------------------


def _password_page(request: Request, user: User, error: str | None = None, changed: bool = False, status_code=200):
    return render(
        request,
        "password.html",
        user,
        error=error,
        changed=changed,
        min_length=MIN_PASSWORD,
        max_length=MAX_PASSWORD,
        status_code=status_code,
    )


@router.get("/settings/password")
def password_page(request: Request, user: WebUser):
    return _password_page(request, user)


@router.post("/settings/password", dependencies=[CsrfChecked])
async def change_password(
    request: Request,
    user: WebUser,
    current_password: Annotated[str, Form()],
    new_password: Annotated[str, Form()],
    new_password_again: Annotated[str, Form()],
):
    """The current password (checked as a login is, limits included) and the new one twice. Every other
    session of the user's ends; this one goes on. API tokens are not touched."""
    error = None
    if new_password != new_password_again:
        error = "The new passwords do not match."
    elif not MIN_PASSWORD <= len(new_password) <= MAX_PASSWORD:
        error = f"The new password must be at least {MIN_PASSWORD} characters (and at most {MAX_PASSWORD})."
    if error:
        return _password_page(request, user, error=error, status_code=400)
    try:
        changed = await service.change_password(user, current_password, new_password, client_address(request))
    except service.LoginThrottled as exc:
        response = _password_page(request, user, error=str(exc), status_code=429)
        response.headers["Retry-After"] = str(exc.retry_after)
        return response
    except service.WrongPassword as exc:
        return _password_page(request, user, error=str(exc), status_code=400)
    request.session["sv"] = changed.session_version  # this session goes on, at the new version
    return _password_page(request, changed, changed=True)


# --- API tokens ----------------------------------------------------------------------------------


def _tokens_page(request: Request, session, user: User, created: str | None = None, error=None, status_code=200):
    tokens, now = service.list_tokens(session, user), utcnow()
    active = sum(1 for t in tokens if t.revoked_at is None and (t.expires_at is None or t.expires_at > now))
    return render(
        request,
        "tokens.html",
        user,
        tokens=tokens,
        active=active,
        created=created,
        error=error,
        max_days=MAX_TOKEN_DAYS,
        now=now,
        status_code=status_code,
    )


@router.get("/settings/tokens")
def tokens_page(request: Request, session: SessionDep, user: WebUser):
    return _tokens_page(request, session, user)


@router.post("/settings/tokens", dependencies=[CsrfChecked])
def create_token(
    request: Request,
    session: SessionDep,
    user: WebUser,
    name: Annotated[str, Form(min_length=1, max_length=100)],
    expires_in_days: Annotated[str, Form()] = "",
):
    days = None
    if expires_in_days.strip():
        try:
            days = int(expires_in_days)
        except ValueError:
            days = 0
        if not 1 <= days <= MAX_TOKEN_DAYS:
            error = f"Expires in: a whole number of days from 1 to {MAX_TOKEN_DAYS}, or empty for never."
            return _tokens_page(request, session, user, error=error, status_code=422)
    _, secret = service.create_token(session, user, name, expires_in_days=days)
    return _tokens_page(request, session, user, created=secret, status_code=201)


@router.post("/settings/tokens/{token_id}/revoke", dependencies=[CsrfChecked])
def revoke_token(token_id: RowId, session: SessionDep, user: WebUser):
    service.revoke_token(session, user, token_id)
    return RedirectResponse("/settings/tokens", status_code=303)


# --- users (admins) ------------------------------------------------------------------------------


def _users_page(request: Request, session, user: User, error: str | None = None, status_code=200):
    if not user.is_admin:
        return render(request, "error.html", user, status=403, detail="Only admins manage users.", status_code=403)
    users = session.exec(select(User).order_by(col(User.id))).all()
    return render(request, "users.html", user, users=users, error=error, status_code=status_code)


@router.get("/settings/users")
def users_page(request: Request, session: SessionDep, user: WebUser):
    return _users_page(request, session, user)


@router.post("/settings/users/{user_id}", dependencies=[CsrfChecked])
def update_user(
    request: Request, user_id: RowId, session: SessionDep, user: WebUser, disabled: Annotated[bool, Form()]
):
    if not user.is_admin:
        return _users_page(request, session, user)
    target = session.get(User, user_id)
    if target is None:
        return _users_page(request, session, user, error=f"No user {user_id}.", status_code=404)
    try:
        service.update_user(session, user, target, UserUpdate(disabled=disabled))
    except FieldError as exc:
        return _users_page(request, session, user, error=str(exc), status_code=409)
    return RedirectResponse("/settings/users", status_code=303)
