"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}


def describe(exc: BaseException) -> str:
    """An exception for a log line: its type, and its message when it has one (many
    network errors have none, and a bare ``()`` says nothing)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.code or self.status,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        if self.status == 401:  # RFC 6750: how to authenticate
            headers = {**(headers or {}), "www-authenticate": "Bearer"}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def sse_error(message: str, code: int = 502) -> bytes:
    """The event that ends a stream which broke mid-way (then ``[DONE]``)."""
    err = {"error": {"message": message, "type": "bad_gateway", "param": None, "code": code}}
    return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
