"""Users, passwords and API tokens."""

import secrets
import time
from datetime import timedelta

from sqlmodel import Session, col, select

from app.auth.models import ApiToken, User, UserCreate
from app.core.config import Settings
from app.core.db import utcnow
from app.core.security import hash_password, hash_token, new_token, verify_password


class UsernameTaken(ValueError):
    pass


def create_user(session: Session, data: UserCreate) -> User:
    if session.exec(select(User).where(User.username == data.username)).first():
        raise UsernameTaken(f"username {data.username!r} is taken")
    user = User(username=data.username, is_admin=data.is_admin, hashed_password=hash_password(data.password))
    session.add(user)
    session.commit()
    session.refresh(user)
    return user


def authenticate(session: Session, username: str, password: str) -> User | None:
    user = session.exec(select(User).where(User.username == username)).first()
    if user is None or not verify_password(password, user.hashed_password):
        return None
    return user


def create_token(session: Session, user: User, name: str, secret: str | None = None) -> tuple[ApiToken, str]:
    """Mint a token; the secret is returned here once and stored only as its hash."""
    secret = secret or new_token()
    assert user.id is not None, "tokens are minted for a saved user"
    token = ApiToken(user_id=user.id, name=name, token_hash=hash_token(secret), prefix=secret[:10])
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


def user_for_token(session: Session, secret: str) -> User | None:
    token_hash = hash_token(secret)
    found = session.exec(
        select(ApiToken, User)
        .join(User, col(User.id) == ApiToken.user_id)
        .where(ApiToken.token_hash == token_hash, col(ApiToken.revoked_at).is_(None))
    ).first()
    if found is None:
        return None
    token, user = found
    now = utcnow()
    if token.last_used_at is None or now - token.last_used_at > _LAST_USED_RESOLUTION:
        token.last_used_at = now
        session.add(token)
        session.commit()
    if len(_recent) > 1000:
        _recent.clear()
    _recent[token_hash] = (time.monotonic() + TOKEN_CACHE_SECONDS, User(**user.model_dump()))
    return user


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
