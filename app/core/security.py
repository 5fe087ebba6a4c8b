"""Password hashing, API-token minting, and secrets kept for later use. Tokens are random and stored only
as sha256; a secret Tunedeck must send on (a judge's API key) is sealed with Fernet under a key derived
from the session secret, so the database alone does not give it away.

An argon2 check takes 64 MiB and tens of milliseconds of a core on purpose: in the web process they run
through `check_password`/`make_password`, a few at a time (TUNEDECK_PASSWORD_CHECKS) in threads of their
own, so a burst of logins neither takes every request thread nor the memory of one check per request."""

import base64
import hashlib
import secrets
from functools import cache

import anyio
import anyio.to_thread
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from itsdangerous import BadSignature, URLSafeTimedSerializer

from app.core.config import get_settings

_hasher = PasswordHasher()
TOKEN_PREFIX = "td_"


def hash_password(password: str) -> str:
    return _hasher.hash(password)


def verify_password(password: str, hashed: str) -> bool:
    try:
        return _hasher.verify(hashed, password)
    except (VerificationError, InvalidHashError):
        return False


@cache
def _dummy_hash() -> str:
    return hash_password(secrets.token_urlsafe(16))


def _check(password: str, hashed: str | None) -> bool:
    # No user: the same work against a hash no password matches, so the time does not tell.
    matched = verify_password(password, hashed or _dummy_hash())
    return matched and hashed is not None


@cache
def _limiter() -> anyio.CapacityLimiter:
    return anyio.CapacityLimiter(get_settings().password_checks)


async def check_password(password: str, hashed: str | None) -> bool:
    """Whether `password` matches `hashed` (None: the user does not exist, and it takes as long)."""
    return await anyio.to_thread.run_sync(_check, password, hashed, limiter=_limiter())


async def make_password(password: str) -> str:
    return await anyio.to_thread.run_sync(hash_password, password, limiter=_limiter())


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer_secret(header: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header's value; None for any other shape."""
    scheme, _, secret = header.partition(" ")
    return secret.strip() if scheme.lower() == "bearer" and secret.strip() else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(10)}"


def _fernet():
    from cryptography.fernet import Fernet

    digest = hashlib.sha256(b"tunedeck secrets\0" + get_settings().session_secret().encode()).digest()
    return Fernet(base64.urlsafe_b64encode(digest))


def seal(secret: str) -> str:
    """``secret`` encrypted and authenticated, to store; ``unseal`` gives it back."""
    return _fernet().encrypt(secret.encode()).decode()


def unseal(sealed: str) -> str:
    """What ``seal`` sealed. Raises ValueError when it was sealed under another session secret."""
    from cryptography.fernet import InvalidToken

    try:
        return _fernet().decrypt(sealed.encode()).decode()
    except InvalidToken:
        raise ValueError("a stored secret cannot be read: TUNEDECK_SECRET_KEY changed since it was stored") from None


# A worker's credential for the files of one row (an artifact's, a dataset's), fetched from the web app's
# internal routes by a worker on another host: the row's id (prefixed by its kind) signed with the secret
# every process of a deployment shares (TUNEDECK_SECRET_KEY).
_WORKER_SALT = "tunedeck.worker-files"
WORKER_TOKEN_SECONDS = 24 * 3600
WORKER_TOKEN_HEADER = "X-Tunedeck-Worker-Token"


def worker_token(row_id: str) -> str:
    """A credential for the files of one artifact or dataset, good for a day."""
    return URLSafeTimedSerializer(get_settings().session_secret(), salt=_WORKER_SALT).dumps(row_id)


def worker_token_allows(token: str, row_id: str) -> bool:
    """Whether ``token`` is a worker credential for ``row_id`` that has not expired."""
    try:
        signed = URLSafeTimedSerializer(get_settings().session_secret(), salt=_WORKER_SALT).loads(
            token, max_age=WORKER_TOKEN_SECONDS
        )
    except BadSignature:
        return False
    return signed == row_id
