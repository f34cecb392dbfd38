"""Every error the API returns has one shape, {"detail": ..., "errors": [{"field", "message"}]},
and bad input never becomes a 500; the OpenAPI document declares that shape for every error each
operation can answer. Also the request body size limit (413)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from api.schemas import ErrorBody, FieldError
from tuner.db import DatabaseError

log = logging.getLogger("tuner.api")


class ApiError(Exception):
    def __init__(self, status: int, detail: str, errors: list[tuple[str, str]] = (), headers=None):
        self.status = status
        self.detail = detail
        self.errors = list(errors)
        self.headers = headers


def error_body(detail: str, errors: list[tuple[str, str]] = ()) -> dict[str, Any]:
    # Built through the model the OpenAPI document declares, so what is sent is what is documented.
    fields = [FieldError(field=str(f), message=str(m)) for f, m in errors]
    return ErrorBody(detail=detail, errors=fields).model_dump()


def _field(loc: tuple[Any, ...]) -> str:
    # ("query", "limit") -> "limit"; ("body", "search", "trials") -> "search.trials"
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("query", "path", "header", "body", "cookie"):
        parts = parts[1:]
    return ".".join(parts)


_DIGITS = re.compile(r"^\^\[0-9\]\{(\d+),(\d+)\}\$$")
_CHOICES = re.compile(r"^\^\(([^()]*)\)\$$")


def _message(e: dict[str, Any]) -> str:
    """Pydantic's message, except where it shows the user a regular expression: a pattern of
    digits or of alternatives says what to send instead."""
    msg = e.get("msg", "invalid value")
    pattern = (e.get("ctx") or {}).get("pattern") if e.get("type") == "string_pattern_mismatch" else None
    if pattern:
        if m := _DIGITS.match(pattern):
            return f"must be a whole number of {m.group(1)} to {m.group(2)} digits"
        if m := _CHOICES.match(pattern):
            return f"must be one of {', '.join(m.group(1).split('|'))}"
    return msg


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(error_body(err.detail, err.errors), err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, err: RequestValidationError) -> JSONResponse:
        errors = [(_field(e.get("loc", ())), _message(e)) for e in err.errors()]
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


# What a status means where `document_errors` declares it. A route that declares a status itself
# (409 on cancel, 404 "no completed trial yet" on best) keeps its own words.
_MEANINGS = {
    401: "No API token was sent.",
    403: "The API token is unknown or revoked.",
    404: "No job has this id.",
    413: "The body is larger than this service accepts (TUNER_MAX_BODY_BYTES).",
    422: "A parameter or the body is invalid; `errors` names each field.",
    503: "The database is unavailable; `detail` says what to check.",
}
# The 422 of an operation that refuses unknown query parameters (`api.routes.v1_router`'s).
UNKNOWN_QUERY_422 = {
    422: {
        "description": "A parameter or the body is invalid, or a query parameter is not one this "
        "operation takes; `errors` names each field."
    }
}
_SCHEMAS = "#/components/schemas/"
_ERROR_CONTENT = {"application/json": {"schema": {"$ref": f"{_SCHEMAS}ErrorBody"}}}
# What FastAPI declares for a 422 by itself: its own validation error, not what `_validation` sends.
_FASTAPI_422 = {"application/json": {"schema": {"$ref": f"{_SCHEMAS}HTTPValidationError"}}}


def _implied_statuses(path: str, operation: dict[str, Any]) -> list[int]:
    """The errors an operation answers by what it is, whether or not its route declares them."""
    statuses = []
    if operation.get("security"):
        statuses += [401, 403, 503]  # the token is looked up in the database
    if "{job_id}" in path:
        statuses.append(404)  # a route under a job id looks the job up first
    if operation.get("parameters") or "requestBody" in operation:
        statuses.append(422)
    if "requestBody" in operation:
        statuses.append(413)  # BodySizeLimit
    return statuses


def document_errors(schema: dict[str, Any]) -> None:
    """Declare, in FastAPI's OpenAPI document, every error each operation can answer, each with
    the body the handlers above send (ErrorBody), in place of FastAPI's own 422 body
    (HTTPValidationError, whose `detail` is an array)."""
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            for status in _implied_statuses(path, operation):
                response = responses.get(str(status))
                if response is None or response.get("content") == _FASTAPI_422:
                    responses[str(status)] = {"description": _MEANINGS[status]}
            for status, response in responses.items():
                # Every 4xx comes from a handler here; a 5xx may have a body of its own (readyz).
                if status.startswith("4") or (status.startswith("5") and "content" not in response):
                    response["content"] = _ERROR_CONTENT
            operation["responses"] = dict(sorted(responses.items()))
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for fastapi_only in ("HTTPValidationError", "ValidationError"):
        components.pop(fastapi_only, None)
    error_schema = ErrorBody.model_json_schema(ref_template=_SCHEMAS + "{model}")
    components.update({**error_schema.pop("$defs"), "ErrorBody": error_schema})


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
