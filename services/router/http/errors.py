"""Every HTTP error in one shape, `{"error": {"message", "type", "param", "code"}}`, and
the project's statuses (services/common/status.py) -> HTTP status codes, in one table.

    ApiError(400, "max_tokens: must be >= 1, got 0", param="max_tokens")
    api_error_of(ServeError)      the front end's refusals and failures, mapped by HTTP_STATUS

A client's mistake is a 4xx, never a 5xx (the `openai` client retries those): 500 is
only for a fault of ours. The `param` of a front-end error is the field its message
starts with (`max_tokens: ...`), in the OpenAI request's own name.
"""

from __future__ import annotations

import math
import re

from pdserve.services.common.status import ServeError, Status

HTTP_STATUS: dict[Status, int] = {
    Status.INVALID_ARGUMENT: 400,
    Status.OUT_OF_RANGE: 400,
    Status.FAILED_PRECONDITION: 400,
    Status.UNAUTHENTICATED: 401,
    Status.PERMISSION_DENIED: 403,
    Status.NOT_FOUND: 404,
    Status.ALREADY_EXISTS: 409,
    Status.ABORTED: 409,
    Status.RESOURCE_EXHAUSTED: 429,
    Status.CANCELLED: 499,  # the client went away (nginx's code): nobody reads it
    Status.UNIMPLEMENTED: 501,
    Status.UNAVAILABLE: 503,
    Status.DEADLINE_EXCEEDED: 504,
    Status.UNKNOWN: 500,
    Status.INTERNAL: 500,
    Status.DATA_LOSS: 500,
}
# OpenAI's error types and codes, by HTTP status.
ERROR_TYPES = {
    400: ("invalid_request_error", "invalid_value"),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "permission_denied"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    409: ("conflict_error", "conflict"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    499: ("cancelled", "cancelled"),
    501: ("server_error", "unimplemented"),
    503: ("server_error", "unavailable"),
    504: ("server_error", "timeout"),
}
# Front-end field names -> the OpenAI request's (what `param` names).
PARAM_NAMES = {"text": "prompt", "token_ids": "prompt", "beam_width": "n"}
_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*):")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        kind, code = ERROR_TYPES.get(self.status, ("server_error", "internal_error"))
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code or code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


def param_of(message: str, names: dict[str, str] | None = None) -> str | None:
    """The field a validation message names (`max_tokens: must be ...` -> max_tokens)."""
    match = _FIELD.match(message)
    if match is None:
        return None
    field = match.group(1)
    return {**PARAM_NAMES, **(names or {})}.get(field, field)


def api_error_of(error: ServeError, names: dict[str, str] | None = None,
                 aliases: dict[str, str] | None = None) -> ApiError:
    """`names`: front-end field -> the request's, for `param`; `aliases`: the same, for
    the message's leading field too (a constraint's `structured_outputs.json_schema`
    is the caller's `response_format.json_schema`), whatever the status."""
    message = renamed(error.message, aliases or {})
    status = HTTP_STATUS.get(error.status, 500)
    param = param_of(message, names) if status == 400 else None
    return ApiError(status, message, param=param, retry_after_s=error.retry_after_s)


def renamed(message: str, names: dict[str, str]) -> str:
    """`message` with its leading field (`field: ...`) renamed by `names`."""
    field, sep, rest = message.partition(":")
    return f"{names[field]}{sep}{rest}" if sep and field in names else message


def invalid(error: ValueError) -> ApiError:
    """A validation ValueError (`field: rule`) as a 400 naming its field."""
    return ApiError(400, str(error), param=param_of(str(error)))


def bad_request(param: str, rule: str) -> ApiError:
    return ApiError(400, f"{param}: {rule}", param=param)
