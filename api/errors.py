"""Every error the API returns has one shape, {"detail": ..., "errors": [{"field", "message"}]},
and bad input never becomes a 500. Also the request body size limit (413)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from tuner.db import DatabaseError

log = logging.getLogger("tuner.api")


class ApiError(Exception):
    def __init__(self, status: int, detail: str, errors: list[tuple[str, str]] = (), headers=None):
        self.status = status
        self.detail = detail
        self.errors = list(errors)
        self.headers = headers


def error_body(detail: str, errors: list[tuple[str, str]] = ()) -> dict[str, Any]:
    return {"detail": detail, "errors": [{"field": f, "message": m} for f, m in errors]}


def _field(loc: tuple[Any, ...]) -> str:
    # ("query", "limit") -> "limit"; ("body", "search", "trials") -> "search.trials"
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("query", "path", "header", "body", "cookie"):
        parts = parts[1:]
    return ".".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(error_body(err.detail, err.errors), err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, err: RequestValidationError) -> JSONResponse:
        errors = [(_field(e.get("loc", ())), e.get("msg", "invalid value")) for e in err.errors()]
        fields = ", ".join(f for f, _ in errors if f) or "request"
        return JSONResponse(error_body(f"invalid {fields}", errors), 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(req: Request, err: StarletteHTTPException) -> JSONResponse:
        headers = dict(getattr(err, "headers", None) or {})
        if err.status_code == 405:
            # Starlette names only the first route's methods; GET and POST /v1/jobs are two routes.
            headers["Allow"] = ", ".join(_allowed_methods(req))
        return JSONResponse(error_body(str(err.detail)), err.status_code, headers=headers or None)

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, err: Exception) -> JSONResponse:
        # A bug, not bad input: keep the error shape, keep the traceback in the log only.
        log.exception("unhandled error", exc_info=err)
        return JSONResponse(error_body("internal error; the server log has the details"), 500)

    @app.exception_handler(DatabaseError)
    async def _database(_req: Request, err: DatabaseError) -> JSONResponse:
        log.error("database error: %s", err)
        return JSONResponse(error_body(f"database unavailable: {err}"), 503)


def _allowed_methods(req: Request) -> list[str]:
    methods: set[str] = set()
    for route in req.app.router.routes:
        if getattr(route, "methods", None) and route.matches(req.scope)[0] != Match.NONE:
            methods |= route.methods
    return sorted(methods - {"HEAD"})  # HEAD is implied by GET and not documented


class _TooLarge(Exception):
    pass


class BodySizeLimit:
    """Refuses bodies over `max_bytes` with 413, by Content-Length up front or while streaming."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send):
        body = json.dumps(
            error_body(
                f"request body is larger than {self.max_bytes} bytes",
                [("body", f"at most {self.max_bytes} bytes (TUNER_MAX_BODY_BYTES)")],
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
