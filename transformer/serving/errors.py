"""The one JSON error body of every status >= 400 (docs/serving.md, /work http contract):
`{"error": {"status", "message", "field"?}}`, for the server's own refusals (`ServeError`) and for what
FastAPI and Starlette answer themselves (422 validation, 404 / 405 routing, malformed bodies)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

__all__ = ["ServeError", "error_response", "install_handlers"]


class ServeError(Exception):
    """A request the server refuses: its status, one line of message, the field at fault (if one is)."""

    def __init__(
        self, status: int, message: str, field: str | None = None, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.headers = dict(headers or {})


def error_response(
    status: int, message: str, field: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    body: dict[str, Any] = {"status": status, "message": " ".join(str(message).split())}
    if field is not None:
        body["field"] = field
    return JSONResponse({"error": body}, status_code=status, headers=dict(headers or {}))


def install_handlers(app: FastAPI) -> None:
    """Every error FastAPI or the server raises answers with the JSON error body."""

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, err: ServeError) -> JSONResponse:
        return error_response(err.status, err.message, err.field, err.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        field, message = validation_message(err.errors())
        return error_response(422, message, field)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException) -> JSONResponse:
        message = err.detail if isinstance(err.detail, str) else str(err.detail)
        if err.status_code == 400 and message == "There was an error parsing the body":
            # FastAPI's answer when the JSON parser cannot decode the bytes (JSON is UTF-8): invalid JSON
            return error_response(422, "the body is not valid JSON: it is not valid UTF-8 text")
        if err.status_code == 404 and message == "Not Found":
            message = f"no such path: {request.url.path}"
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return error_response(err.status_code, message, headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        log.exception("Internal error answering %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(err).__name__}: {_first_line(err)}")


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str | None, str]:
    """pydantic's error list -> (the dotted field of the first error, one line naming it)."""
    if not errors:
        return None, "invalid request"
    first = errors[0]
    if "str" in first.get("loc", ()):  # a segment: a string or an object, tried in this order
        if isinstance(first.get("input"), dict):  # an object: its own field at fault
            first = next((e for e in errors if "SegmentIn" in e.get("loc", ())), first)
        else:
            first = {
                **first,
                "msg": "a segment must be a string or an object {text, prefix, constraints, avoid}",
            }
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    # a segment given as an object is tried as a string, then as the object: name the object's field
    location = [part for part in location if part not in ("str", "SegmentIn")]
    field = ".".join(location) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return None, f"the body is not valid JSON: {detail or first.get('msg', '')}".strip()
    message = first.get("msg", "invalid value")
    if kind == "extra_forbidden":
        message = "unknown field"
    elif kind == "missing":
        message = "required field missing"
    given = first.get("input")
    shown = "" if kind in ("missing", "json_invalid") else f" (got {_short(given)})"
    return field, f"{field or 'body'}: {message}{shown}"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]
