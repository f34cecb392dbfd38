"""The API's routers: jobs (and their trials, best, build), job events (SSE), service endpoints.
Every /v1 router is made by `v1_router`, so each of its operations refuses unknown query
parameters (`api.deps.refuse_unknown_query`) and its OpenAPI entry declares that 422."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from api.deps import refuse_unknown_query
from api.errors import UNKNOWN_QUERY_422


def v1_router(path: str = "", **kwargs: Any) -> APIRouter:
    """A router for operations under /v1 + `path` (APIRouter's other arguments pass through)."""
    return APIRouter(
        prefix=f"/v1{path}",
        dependencies=[Depends(refuse_unknown_query)],
        responses=UNKNOWN_QUERY_422,
        **kwargs,
    )
