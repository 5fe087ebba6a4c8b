"""Users, passwords, logins and API tokens."""

import math
import secrets
import time
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import delete, update
from sqlmodel import Session, col, select
from starlette.concurrency import run_in_threadpool

from app.auth.models import ApiToken, LoginFailure, User, UserCreate, UserUpdate
from app.core.config import Settings, get_settings
from app.core.db import session_scope, utcnow
from app.core.errors import FieldError
from app.core.security import check_password, hash_password, hash_token, make_password, new_token


class UsernameTaken(ValueError):
    pass


class LoginThrottled(Exception):
    """Too many failed logins in the window: answered 429, with when to try again."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class AccountDisabled(Exception):
    pass


class WrongPassword(ValueError):
    pass


class TokenRefused(Exception):
    """A token that does not (or no longer) authenticate, with the reason the client is told."""


def create_user(session: Session, data: UserCreate) -> User:
    if session.exec(select(User).where(User.username == data.username)).first():
        raise UsernameTaken(f"username {data.username!r} is taken")
    user = User(username=data.username, is_admin=data.is_admin, hashed_password=hash_password(data.password))
    session.add(user)
    session.commit()
    session.refresh(user)
    return user


def update_user(session: Session, admin: User, user: User, data: UserUpdate) -> User:
    """An admin's change to a user: only the fields sent. Disabling ends the user's sessions, tokens and
    streams at once (its tokens are refused while disabled; they work again if it is enabled again). A
    limit set to null is the setting's again."""
    changes = data.model_dump(exclude_unset=True)
    disable = changes.pop("disabled", None)
    if disable is not None and disable != user.disabled:
        if disable and user.id == admin.id:
            raise FieldError("disabled", "you cannot disable your own account", conflict=True)
        user.disabled = disable
        if disable:
            user.session_version += 1
            forget_user(user.id)
    for field, value in changes.items():  # the limits
        setattr(user, field, value)
    session.add(user)
    session.commit()
    session.refresh(user)
    return user


class LimitReached(Exception):
    """The user is at one of their limits (answered 429, naming it)."""


def check_limit(session: Session, owner_id: int, limit: str, count: Callable[[], int], noun: str) -> None:
    """Raise LimitReached when the user has reached their ``limit`` (a column of users: their own, else the
    setting of that name). ``count`` counts what they have (``noun``s) once the user's row is locked until the
    caller commits, so that two requests of the same user at once are counted one after the other on
    PostgreSQL (SQLite has no row locks: two requests at the very same moment may both pass)."""
    own = session.exec(select(getattr(User, limit)).where(col(User.id) == owner_id).with_for_update()).one()
    allowed = own if own is not None else getattr(get_settings(), limit)
    have = count()
    if have >= allowed:
        raise LimitReached(
            f"you have {have} {noun}{'' if have == 1 else 's'}; your limit is {allowed} (an admin can raise it)"
        )


# --- logins -------------------------------------------------------------------------------------
# Failed logins are rows in the database (login_failures), so every web process counts the same ones;
# only failures are written, so at most the limit per username or address each window, and rows older
# than the window are deleted as new ones come.


def _wait(session: Session, column, value: str, limit: int, since: datetime, window: timedelta) -> int | None:
    """Seconds until `value` has fewer than `limit` failures in the window (None: it has fewer now)."""
    recent = session.exec(
        select(LoginFailure.at)
        .where(column == value, col(LoginFailure.at) > since)
        .order_by(col(LoginFailure.at).desc())
        .limit(limit)
    ).all()
    if len(recent) < limit:
        return None
    return max(1, math.ceil((recent[limit - 1] + window - utcnow()).total_seconds()))


def throttled(session: Session, settings: Settings, username: str, address: str) -> LoginThrottled | None:
    window = timedelta(seconds=settings.login_window_seconds)
    since = utcnow() - window
    wait = _wait(session, LoginFailure.username, username[:64], settings.login_failures_per_account, since, window)
    if wait is not None:
        return LoginThrottled(f"Too many failed logins for this account: try again in {wait} seconds.", wait)
    wait = _wait(session, LoginFailure.address, address[:64], settings.login_failures_per_address, since, window)
    if wait is not None:
        return LoginThrottled(f"Too many failed logins from your address: try again in {wait} seconds.", wait)
    return None


def _failed(username: str, address: str) -> None:
    now = utcnow()
    with session_scope() as session:
        session.add(LoginFailure(username=username[:64], address=address[:64], at=now))
        cutoff = now - timedelta(seconds=get_settings().login_window_seconds)
        session.execute(delete(LoginFailure).where(col(LoginFailure.at) < cutoff))
        session.commit()


def _succeeded(username: str) -> None:
    with session_scope() as session:
        session.execute(delete(LoginFailure).where(col(LoginFailure.username) == username[:64]))
        session.commit()


async def login(username: str, password: str, address: str) -> User | None:
    """The user whose password this is (None: wrong username or password). Raises LoginThrottled when
    the username or the address failed too often lately (nothing is checked then), AccountDisabled
    for a disabled user's right password. An unknown username costs the same time as a wrong password."""

    def look_up() -> tuple[LoginThrottled | None, User | None]:
        with session_scope() as session:
            wait = throttled(session, get_settings(), username, address)
            user = None if wait else session.exec(select(User).where(User.username == username)).first()
            return wait, user

    wait, user = await run_in_threadpool(look_up)
    if wait is not None:
        raise wait
    matched = await check_password(password, user.hashed_password if user is not None else None)
    if user is None or not matched:
        await run_in_threadpool(_failed, username, address)
        return None
    if user.disabled:
        raise AccountDisabled(f"The account {user.username!r} is disabled: ask an admin.")
    await run_in_threadpool(_succeeded, username)
    return user


async def change_password(user: User, current: str, new: str, address: str) -> User:
    """Check `current` as a login would (it counts as one, limits included), then set `new` and end
    every session of the user's (the caller keeps its own by taking the new `session_version`)."""
    if await login(user.username, current, address) is None:
        raise WrongPassword("The current password is wrong.")
    hashed = await make_password(new)

    def save() -> User:
        with session_scope() as session:
            session.execute(
                update(User)
                .where(col(User.id) == user.id)
                .values(hashed_password=hashed, session_version=User.session_version + 1)
            )
            session.commit()
            changed = session.get(User, user.id)
            assert changed is not None
            session.expunge(changed)
            return changed

    return await run_in_threadpool(save)


def session_user(session: Session, user_id: object, version: object) -> User | None:
    """The user of a session cookie, if that session still holds (not ended, user not disabled)."""
    user = session.get(User, user_id) if isinstance(user_id, int) else None
    if user is None or user.disabled or user.session_version != version:
        return None
    return user


# --- API tokens ---------------------------------------------------------------------------------


def create_token(
    session: Session, user: User, name: str, secret: str | None = None, expires_in_days: int | None = None
) -> tuple[ApiToken, str]:
    """Mint a token; the secret is returned here once and stored only as its hash."""
    secret = secret or new_token()
    assert user.id is not None, "tokens are minted for a saved user"
    expires_at = utcnow() + timedelta(days=expires_in_days) if expires_in_days else None
    token = ApiToken(
        user_id=user.id, name=name, token_hash=hash_token(secret), prefix=secret[:10], expires_at=expires_at
    )
    session.add(token)
    session.commit()
    session.refresh(token)
    return token, secret


_LAST_USED_RESOLUTION = timedelta(minutes=1)

# Tokens that passed recently: hash -> (until, a detached copy of their user). A hit costs no query
# and no thread, which the gateway's time to first token depends on. Revoking a token forgets it at
# once in this process; other web processes notice within TOKEN_CACHE_SECONDS.
TOKEN_CACHE_SECONDS = 5.0
_recent: dict[str, tuple[float, User]] = {}


def recent_user(secret: str) -> User | None:
    """The user of a token that passed in the last TOKEN_CACHE_SECONDS (else None: ask the database)."""
    hit = _recent.get(hash_token(secret))
    return hit[1] if hit is not None and hit[0] > time.monotonic() else None


def _token(session: Session, secret: str) -> tuple[ApiToken | None, User | None, str | None]:
    """The token, its user, and why it is refused (None: it authenticates)."""
    found = session.exec(
        select(ApiToken, User)
        .join(User, col(User.id) == ApiToken.user_id)
        .where(ApiToken.token_hash == hash_token(secret))
    ).first()
    if found is None or found[0].revoked_at is not None:
        return None, None, "invalid or revoked API token"
    token, user = found
    if token.expires_at is not None and token.expires_at <= utcnow():
        return token, user, f"API token expired at {token.expires_at:%Y-%m-%d %H:%M:%S} UTC"
    if user.disabled:
        return token, user, f"user {user.username!r} is disabled"
    return token, user, None


def token_refusal(session: Session, secret: str) -> str | None:
    """Why this token no longer authenticates (None: it does); reads only (for live streams' checks)."""
    return _token(session, secret)[2]


def user_for_token(session: Session, secret: str) -> User:
    """The token's user; TokenRefused naming why when the token is unknown, revoked, expired, or its
    user disabled."""
    token, user, refusal = _token(session, secret)
    if refusal is not None or token is None or user is None:
        raise TokenRefused(refusal)
    now = utcnow()
    if token.last_used_at is None or now - token.last_used_at > _LAST_USED_RESOLUTION:
        token.last_used_at = now
        session.add(token)
        session.commit()
    if len(_recent) > 1000:
        _recent.clear()
    remembered = TOKEN_CACHE_SECONDS
    if token.expires_at is not None:  # never past its expiry
        remembered = min(remembered, (token.expires_at - now).total_seconds())
    _recent[token.token_hash] = (time.monotonic() + remembered, User(**user.model_dump()))
    return user


def forget_user(user_id: int | None) -> None:
    """Drop the user's tokens from this process's memory of recent ones (other web processes drop
    them within TOKEN_CACHE_SECONDS)."""
    for token_hash, (_, user) in list(_recent.items()):
        if user.id == user_id:
            _recent.pop(token_hash, None)


def list_tokens(session: Session, user: User) -> list[ApiToken]:
    return list(session.exec(select(ApiToken).where(ApiToken.user_id == user.id).order_by(col(ApiToken.id).desc())))


def revoke_token(session: Session, user: User, token_id: int) -> ApiToken | None:
    token = session.get(ApiToken, token_id)
    if token is None or token.user_id != user.id:
        return None
    _recent.pop(token.token_hash, None)
    if token.revoked_at is None:
        token.revoked_at = utcnow()
        session.add(token)
        session.commit()
        session.refresh(token)
    return token


def admin_user(session: Session, settings: Settings) -> User | None:
    return session.exec(select(User).where(User.username == settings.admin_username)).first()


def bootstrap(session: Session, settings: Settings) -> dict[str, str]:
    """Make sure an admin exists (first start) and TUNEDECK_ADMIN_TOKEN is a live token.

    Returns the secrets created now, to print once: {"password": ..., "token": ...}.
    """
    created: dict[str, str] = {}
    admin = admin_user(session, settings)
    if admin is None:
        password = settings.admin_password or secrets.token_urlsafe(12)
        admin = create_user(session, UserCreate(username=settings.admin_username, password=password, is_admin=True))
        if not settings.admin_password:
            created["password"] = password
        if not settings.admin_token:
            _, created["token"] = create_token(session, admin, "first start")
    if settings.admin_token:
        existing = session.exec(select(ApiToken).where(ApiToken.token_hash == hash_token(settings.admin_token))).first()
        if existing is None:
            create_token(session, admin, "TUNEDECK_ADMIN_TOKEN", secret=settings.admin_token)
    return created
