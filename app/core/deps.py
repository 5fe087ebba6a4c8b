"""Dependency aliases shared by every router: the DB session and who is asking.

API routes take `Authorization: Bearer <token>`. The dashboard's own scripts call the same API
with the session cookie instead; then any state-changing request must carry the session's CSRF
token in `X-CSRF-Token`.
"""

import secrets
from typing import Annotated

from fastapi import Depends, Form, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from sqlmodel import Session

from app.auth import service as auth_service
from app.auth.models import User
from app.core.db import get_session, release, session_scope
from app.core.security import bearer_secret

SessionDep = Annotated[Session, Depends(get_session)]

SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


def csrf_token(request: Request) -> str:
    token = request.session.get("csrf")
    if not token:
        token = request.session["csrf"] = secrets.token_urlsafe(32)
    return token


def _csrf_ok(request: Request, supplied: str | None) -> bool:
    expected = request.session.get("csrf")
    return bool(expected and supplied and secrets.compare_digest(expected, supplied))


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail, headers={"WWW-Authenticate": "Bearer"})


async def get_current_user(request: Request, session: SessionDep) -> User:
    secret = _bearer(request)
    if secret is not None and (user := auth_service.recent_user(secret)) is not None:
        return user  # no query, no thread
    return await run_in_threadpool(_authenticate, request, session, secret)


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if not header:
        return None
    if (secret := bearer_secret(header)) is None:
        raise _unauthorized("Authorization header must be 'Bearer <token>'")
    return secret


def _authenticate(request: Request, session: Session, secret: str | None) -> User:
    try:
        return _user_of(request, session, secret)
    finally:
        release(session)


def _user_of(request: Request, session: Session, secret: str | None) -> User:
    if secret is not None:
        try:
            return auth_service.user_for_token(session, secret)
        except auth_service.TokenRefused as exc:
            raise _unauthorized(str(exc)) from None
    logged_in = "user_id" in request.session
    user = session_user(request, session)
    if user is None:
        raise _unauthorized(SESSION_ENDED if logged_in else "missing API token: send 'Authorization: Bearer <token>'")
    if request.method not in SAFE_METHODS and not _csrf_ok(request, request.headers.get("x-csrf-token")):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "missing or wrong X-CSRF-Token header")
    return user


CurrentUser = Annotated[User, Depends(get_current_user)]

SESSION_ENDED = "your session has ended (password changed, or account disabled): log in again"


def log_in(request: Request, user: User) -> None:
    """Make the request's session cookie this user's: a fresh session (and CSRF token) carrying the
    user's session version, which ends it once the version moves on."""
    request.session.clear()
    request.session["user_id"] = user.id
    request.session["sv"] = user.session_version


def session_user(request: Request, session: Session) -> User | None:
    """The user of the request's session cookie, if that session still holds; one that ended is
    cleared (the browser's cookie with it)."""
    if "user_id" not in request.session:
        return None
    user = auth_service.session_user(session, request.session["user_id"], request.session.get("sv", 0))
    if user is None:
        request.session.clear()
    return user


def refusal(request: Request) -> str | None:
    """Why the request's credentials no longer hold (None: they do): asked again and again by live
    streams, in a session of its own, from the database (no cache)."""
    header = request.headers.get("authorization")
    secret = bearer_secret(header) if header else None
    with session_scope() as session:
        if secret is not None:
            return auth_service.token_refusal(session, secret)
        user_id = request.session.get("user_id")
        if auth_service.session_user(session, user_id, request.session.get("sv", 0)) is None:
            return SESSION_ENDED
    return None


def get_admin(user: CurrentUser) -> User:
    if not user.is_admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "admin only")
    return user


AdminUser = Annotated[User, Depends(get_admin)]


class LoginRequired(Exception):
    """Raised by page dependencies; answered with a redirect to the login page."""


def get_web_user(request: Request, session: SessionDep) -> User:
    user = session_user(request, session)
    release(session)
    if user is None:
        raise LoginRequired()
    return user


WebUser = Annotated[User, Depends(get_web_user)]


def verify_csrf_form(request: Request, csrf_token: Annotated[str, Form()] = "") -> None:
    if not _csrf_ok(request, csrf_token):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "missing or wrong CSRF token; reload the page and try again")


CsrfChecked = Depends(verify_csrf_form)
