"""OpenAI's error shape for the gateway's errors: `{"error": {"message", "type", "param", "code"}}`
with the HTTP status each gateway error code stands for (`code` is the gateway's error code,
docs/protocol.md), also for unknown routes and wrong methods under /v1, and for the end of a
request that failed or was cancelled (`done_error`).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from shared.errors import ErrorCode
from shared.protocol import Done

# HTTP status and OpenAI error `type` for each gateway error code
_STATUS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.UNAUTHORIZED: (401, "authentication_error"),
    ErrorCode.ORIGIN_NOT_ALLOWED: (403, "permission_error"),
    ErrorCode.RATE_LIMITED: (429, "rate_limit_error"),
    ErrorCode.CONCURRENCY_LIMIT: (429, "rate_limit_error"),
    ErrorCode.OVERLOADED: (503, "overloaded_error"),
    ErrorCode.BACKEND_UNAVAILABLE: (503, "server_error"),
    ErrorCode.SHUTTING_DOWN: (503, "server_error"),
    ErrorCode.WORKER_LOST: (503, "server_error"),
    # retryable failures on the server's side: a 5xx, which the SDKs retry (with a stream's held
    # headers they can arrive before the first token, as the response status)
    ErrorCode.STALLED: (503, "server_error"),
    ErrorCode.OUTPUT_LOST: (503, "server_error"),
    ErrorCode.OUTPUT_WRITE_FAILED: (503, "server_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
    ErrorCode.RESUME_EXPIRED: (404, "not_found_error"),
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    @classmethod
    def from_code(cls, code: ErrorCode | str, message: str, param: str | None = None) -> "APIError":
        try:
            code = ErrorCode(code)
        except ValueError:
            code = ErrorCode.INTERNAL
        status, kind = _STATUS.get(code, (400, "invalid_request_error"))
        return cls(status, message, type=kind, code=code.value, param=param)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _unsupported(name: str, why: str = "is not supported by this server") -> APIError:
    return APIError(400, f"'{name}' {why}", code="unsupported_parameter", param=name)



CANCELLED_CODE = "request_cancelled"     # the end of a cancelled request, as an OpenAI error (410)


def done_error(done: Done) -> APIError | None:
    """The OpenAI error a `done` stands for, or None for an answer (stop, length).

    `cancelled` is no OpenAI finish_reason (stop, length, tool_calls, content_filter,
    function_call), and a client that sees one of those takes the answer for complete. The only
    client that can receive the end of a cancelled request is one that comes back to it (a
    `GET /v1/streams/{id}` resume, an Idempotency-Key retry): it gets what was generated, then
    an error, `code: "request_cancelled"`, which the SDKs raise (openai-python and openai-node
    raise `APIError` on a stream's `{"error": ...}` event), so the truncation is never silent."""
    if done.finish_reason == "error":
        err = done.error or {}
        return APIError.from_code(err.get("code", "internal"), err.get("message", ""), err.get("param"))
    if done.finish_reason == "cancelled":
        return APIError(410, f"the request was cancelled (its client disconnected or cancelled it) after "
                             f"{done.usage.completion_tokens} tokens; its output ends here, incomplete",
                        code=CANCELLED_CODE)
    return None


async def http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's 404 (no route) and 405 (wrong method): OpenAI's error JSON under /v1, so an
    SDK raises `NotFoundError` with a message; Starlette's plain text everywhere else."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if path != "/v1" and not path.startswith("/v1/"):
        if exc.status_code in (204, 304):
            return Response(status_code=exc.status_code, headers=exc.headers)
        return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)
    if exc.status_code == 404:
        error = APIError(404, f"Invalid URL ({request.method} {path}): no such endpoint (this server serves "
                              "/v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /v1/streams/{id}; see "
                              "docs/clients.md)", code="not_found")
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        error = APIError(405, f"Method {request.method} is not allowed on {path} (allowed: {allowed})",
                         code="method_not_allowed")
    else:
        error = APIError(exc.status_code, str(exc.detail), code=None)
    response = error.response()
    response.headers.update(exc.headers or {})
    return response

