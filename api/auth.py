"""API tokens: created once and shown once, stored only as a sha256 hash, revocable by name."""

from __future__ import annotations

import hashlib
import re
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from tuner.db import ApiToken, utcnow

TOKEN_PREFIX = "tnr_"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


class TokenError(ValueError):
    pass


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(session: Session, name: str) -> str:
    """Store a new token under `name` and return the token itself (the only time it exists)."""
    if not _NAME.match(name):
        raise TokenError(f"--name {name!r}: use letters, digits, '.', '_' or '-' (at most 100)")
    existing = session.scalar(select(ApiToken).where(ApiToken.name == name))
    if existing is not None and existing.revoked_at is not None:
        raise TokenError(f"--name {name!r}: a revoked token keeps its name (so the list still shows "
                         f"when it was revoked); pick another name, e.g. a version: {name}-2")  # fmt: skip
    if existing is not None:
        raise TokenError(f"--name {name!r}: a token with this name exists; revoke it or pick another name")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(name=name, token_sha256=hash_token(token)))
    return token


def revoke_token(session: Session, name: str) -> None:
    row = session.scalar(select(ApiToken).where(ApiToken.name == name))
    if row is None:
        raise TokenError(f"no token named {name!r}; `tuner token list` shows the names")
    if row.revoked_at is None:
        row.revoked_at = utcnow()


def list_tokens(session: Session) -> list[ApiToken]:
    return list(session.scalars(select(ApiToken).order_by(ApiToken.created_at)))


def find_token(session: Session, token: str) -> ApiToken | None:
    """The live (not revoked) token row for a presented token, or None."""
    row = session.scalar(select(ApiToken).where(ApiToken.token_sha256 == hash_token(token)))
    return row if row is not None and row.revoked_at is None else None
