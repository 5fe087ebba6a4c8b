"""Password hashing and API-token minting. Tokens are random and stored only as sha256."""

import hashlib
import secrets

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

_hasher = PasswordHasher()
TOKEN_PREFIX = "td_"


def hash_password(password: str) -> str:
    return _hasher.hash(password)


def verify_password(password: str, hashed: str) -> bool:
    try:
        return _hasher.verify(hashed, password)
    except (VerificationError, InvalidHashError):
        return False


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
