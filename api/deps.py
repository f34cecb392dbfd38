"""Dependencies as `Annotated` aliases, so routes stay thin and tests can override them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.auth import find_token
from api.errors import ApiError
from api.settings import Settings
from tuner.db import ApiToken, session_scope


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_session(settings: SettingsDep) -> Iterator[Session]:
    with session_scope(settings.database_url) as session:
        yield session


# scope="function": the transaction commits when the route returns, before the response is sent.
# FastAPI's default for a dependency with yield (since 0.121) ends it after the response, so a
# client could read the 202 of a new job, follow its Location and get 404 (it did, in CI), a
# failed commit still answered 202, and an event stream held its session open while it ran.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]

_bearer = HTTPBearer(auto_error=False, description="A token from `tuner token create --name NAME`.")
_Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _check(session: Session, creds: HTTPAuthorizationCredentials | None) -> ApiToken:
    if creds is None or not creds.credentials:
        raise ApiError(
            401,
            "missing API token: send 'Authorization: Bearer <token>' (create one with `tuner token create`)",
            [("Authorization", "required")],
            headers={"WWW-Authenticate": "Bearer"},
        )
    token = find_token(session, creds.credentials)
    if token is None:
        raise ApiError(
            403, "API token is unknown or revoked", [("Authorization", "unknown or revoked token")]
        )
    return token


def require_write(session: SessionDep, creds: _Credentials) -> ApiToken:
    return _check(session, creds)


def require_read(session: SessionDep, settings: SettingsDep, creds: _Credentials) -> ApiToken | None:
    if settings.public_reads and creds is None:
        return None
    return _check(session, creds)


WriteAuth = Annotated[ApiToken, Depends(require_write)]
ReadAuth = Annotated[ApiToken | None, Depends(require_read)]


def _query_names(dependant: Dependant) -> list[str]:
    """The query parameters an operation declares, its dependencies' included, in their order
    (each one by one: a pydantic model of query parameters would need its fields listed here)."""
    names = [field.alias for field in dependant.query_params]
    for sub in dependant.dependencies:
        names += [n for n in _query_names(sub) if n not in names]
    return names


def refuse_unknown_query(request: Request) -> None:
    """422 for a query parameter the operation does not declare, naming the ones it takes:
    FastAPI ignores them, so a misspelt `?staus=failed` listed every job and `?devcies=8` planned
    for the recipe's own device count. Every /v1 router runs it (`api.routes.v1_router`)."""
    route = request.scope.get("route")  # the matched APIRoute, set by FastAPI before dependencies
    if route is None:
        return
    known = _query_names(route.dependant)
    unknown = sorted(set(request.query_params) - set(known))
    if unknown:
        takes = ", ".join(known) or "no query parameters"
        raise ApiError(
            422,
            f"unknown query parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}",
            [(f"query.{name}", f"unknown; this endpoint takes {takes}") for name in unknown],
        )
