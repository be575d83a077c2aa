"""vLLM's error envelope: `{"error": {"message", "type", "param", "code"}}`, and the exception handlers that emit it.

Every failure a client can cause is a 400 BadRequestError (pydantic validation included, never FastAPI's 422);
an unknown model is a 404 NotFoundError; a missing API key a 401; a body over the limit a 413; FastAPI's own 404
and 405 answers use the envelope too (type: the HTTP status phrase, as vLLM's handler does). Anything unexpected is
a logged 500; a client that drops mid-upload is logged as one info line, not as an error.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

import jinja2
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from deltaserve.engine.core_client import EngineDeadError
from deltaserve.engine.frontend import RequestError
from deltaserve.sampling_params import validation_message

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with its HTTP status, vLLM error type and offending parameter."""

    def __init__(
        self, message: str, *, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param

    def payload(self) -> dict[str, Any]:
        return error_payload(self.message, self.err_type, self.status, self.param)


class ParamValueError(ValueError):
    """A request model validator's error naming its field, as vLLM's VLLMValidationError (vllm/exceptions.py): the
    message ends with "(parameter=NAME)" and the 400 names NAME as its param (vLLM's validation_exception_handler,
    vllm/entrypoints/serve/utils/server_utils.py)."""

    def __init__(self, message: str, param: str, value: Any = None) -> None:
        super().__init__(message)
        self.param = param
        self.value = value  # vLLM names the rejected value too, when there is one

    def __str__(self) -> str:
        return validation_message(super().__str__(), self.param, self.value)


def error_payload(message: str, err_type: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, param=param)


def model_not_found(name: str) -> APIError:
    return APIError(f"The model `{name}` does not exist.", status=404, err_type="NotFoundError", param="model")


def unauthorized() -> APIError:
    return APIError("Unauthorized", status=401, err_type="AuthenticationError")


def request_too_large(max_body_bytes: int) -> APIError:
    return APIError(
        f"The request body is larger than the server's limit of {max_body_bytes} bytes (--max-request-body-bytes).",
        status=413,
        err_type=HTTPStatus.REQUEST_ENTITY_TOO_LARGE.phrase,
    )


class ClientGone(Exception):
    """The client disconnected before its request body arrived in full."""


# Pydantic names the union member that failed inside the location (prompt.str, prompt.list[int]); dropped.
UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "literal"})


def _location(loc: tuple[Any, ...], prefix: str | None) -> str | None:
    parts = [prefix] if prefix else []
    for part in loc:
        text = str(part)
        if "[" in text or "-" in text or text.lower() in UNION_TAGS:
            continue
        parts.append(text)
    return ".".join(parts) or None


# vLLM's bounds on a validation message: pydantic repeats the offending value in every error, so a large malformed
# body would otherwise come back many times over.
MAX_REPORTED_ERRORS = 10
MAX_INPUT_CHARS = 200
MAX_ERROR_CHARS = 1000


def _summarize_input(value: Any) -> Any:
    """A bounded stand-in for an error's input: containers are described, long text is cut."""
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    if isinstance(value, bytes | bytearray):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    try:
        text = value if isinstance(value, str) else str(value)
    except ValueError:  # an int past Python's digit limit
        return f"<{type(value).__name__}>"
    return text[:MAX_INPUT_CHARS] + "...[truncated]" if len(text) > MAX_INPUT_CHARS else text


def _format_error(error: dict[str, Any], prefix: str | None) -> str:
    """One error as vLLM renders it: the pydantic entry (type, loc, msg, input, ctx) with a dotted location."""
    entry: dict[str, Any] = {"type": error.get("type"), "loc": _location(tuple(error.get("loc", ())), prefix),
                             "msg": error.get("msg", "invalid value")}  # fmt: skip
    if "input" in error:
        entry["input"] = _summarize_input(error["input"])
    if error.get("ctx"):
        entry["ctx"] = {key: value if isinstance(value, int | float | str) else str(value)
                        for key, value in error["ctx"].items()}  # fmt: skip
    text = str(entry)
    return text[:MAX_ERROR_CHARS] + "...[truncated]" if len(text) > MAX_ERROR_CHARS else text


def validation_error(exc: pydantic.ValidationError | RequestValidationError, prefix: str | None = "body") -> APIError:
    """vLLM's message for request-model validation: 'N validation error(s):' then one pydantic entry a line (its
    type included, e.g. greater_than_equal), at most ten; param = the field a ParamValueError names, else the first
    dotted location."""
    errors = exc.errors()
    num_errors = len(errors)
    noun = "error" if num_errors == 1 else "errors"
    lines = [f"  {_format_error(error, prefix)}" for error in errors[:MAX_REPORTED_ERRORS]]
    if num_errors > MAX_REPORTED_ERRORS:
        lines.append(f"  ...and {num_errors - MAX_REPORTED_ERRORS} more {noun}")
    causes = [(error.get("ctx") or {}).get("error") for error in errors]
    named = [cause.param for cause in causes if isinstance(cause, ParamValueError)]
    param = named[0] if named else _location(tuple(errors[0].get("loc", ())), prefix) if errors else None
    return APIError(f"{num_errors} validation {noun}:\n" + "\n".join(lines), param=param)


def to_api_error(exc: BaseException) -> APIError:
    """Maps an exception to the status vLLM gives it: user-caused errors are 400s, the rest 500s."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, pydantic.ValidationError):
        return validation_error(exc)
    if isinstance(exc, EngineDeadError):
        # the engine core died: every stream ends with this, /health fails and the server exits non-zero
        return APIError(f"The engine is dead: {exc}", status=503, err_type="ServiceUnavailableError")
    if isinstance(exc, RequestError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, NotImplementedError):
        return APIError(str(exc) or "Not implemented.", status=501, err_type="NotImplementedError")
    if isinstance(exc, ValueError | TypeError | OverflowError | jinja2.TemplateError | RecursionError):
        return bad_request(str(exc) or type(exc).__name__)
    if isinstance(exc, StarletteHTTPException):
        phrase = HTTPStatus(exc.status_code).phrase
        return APIError(str(exc.detail or phrase), status=exc.status_code, err_type=phrase)
    return APIError("Internal server error.", status=500, err_type="InternalServerError")


def error_response(err: APIError) -> JSONResponse:
    response = JSONResponse(err.payload(), status_code=err.status)
    if err.status == 408:
        # the client stalled mid-body: the rest of it is never read, so the connection cannot serve another request
        response.headers["Connection"] = "close"
    return response


async def _handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(to_api_error(exc))


async def _handle_request_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error(exc, prefix=None))


async def _handle_internal(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(to_api_error(exc))


async def _handle_engine_dead(request: Request, exc: Exception) -> JSONResponse:
    # The engine's death is logged once, as an ERROR, where it is detected: here one line per failed request.
    logger.warning("%s %s failed: the engine is dead", request.method, request.url.path)
    return error_response(to_api_error(exc))


async def _handle_client_gone(request: Request, exc: Exception) -> Response:
    logger.info("client disconnected during the upload of %s %s", request.method, request.url.path)
    return Response(status_code=499)


def install_error_handlers(app: FastAPI) -> None:
    """Client errors are handled per class (no traceback logged); anything else is a logged 500."""
    app.add_exception_handler(StarletteHTTPException, _handle_api_error)
    app.add_exception_handler(ClientGone, _handle_client_gone)
    app.add_exception_handler(ClientDisconnect, _handle_client_gone)
    app.add_exception_handler(RequestValidationError, _handle_request_validation)
    for cls in (APIError, pydantic.ValidationError, ValueError, TypeError, OverflowError, RecursionError):
        app.add_exception_handler(cls, _handle_api_error)
    app.add_exception_handler(jinja2.TemplateError, _handle_api_error)
    app.add_exception_handler(NotImplementedError, _handle_api_error)
    app.add_exception_handler(EngineDeadError, _handle_engine_dead)
    app.add_exception_handler(Exception, _handle_internal)
