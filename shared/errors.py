"""Typed error codes shared by both hops. Clients switch on `code`, never on the message text."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    # the frame itself
    BAD_FRAME = "bad_frame"                    # not JSON / not msgpack / not an object
    FRAME_TOO_LARGE = "frame_too_large"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_TYPE = "unknown_type"
    INVALID_REQUEST = "invalid_request"        # a field is missing, mistyped or out of range
    MISSING_ID = "missing_id"
    DUPLICATE_ID = "duplicate_id"
    UNKNOWN_ID = "unknown_id"
    PROMPT_TOO_LARGE = "prompt_too_large"
    MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
    TOO_MANY_REQUESTS_ON_SOCKET = "too_many_requests_on_socket"
    # who may ask
    UNAUTHORIZED = "unauthorized"
    ORIGIN_NOT_ALLOWED = "origin_not_allowed"
    RATE_LIMITED = "rate_limited"
    CONCURRENCY_LIMIT = "concurrency_limit"
    OVERLOADED = "overloaded"                  # queue too deep or no worker alive
    TOO_MANY_SOCKETS = "too_many_sockets"      # the key or the address holds too many sockets on this replica
    # while serving
    CONTEXT_TOO_LONG = "context_too_long"      # prompt + max_tokens can never fit the KV cache
    WORKER_LOST = "worker_lost"                # the worker died and the request could not be replayed
    BACKEND_UNAVAILABLE = "backend_unavailable"  # Redis unreachable
    OUTPUT_WRITE_FAILED = "output_write_failed"  # Redis kept refusing the worker's output (e.g. out of memory)
    OUTPUT_LOST = "output_lost"                # part of the output can no longer be delivered (history lost)
    RESUME_EXPIRED = "resume_expired"          # output no longer retained
    RESUMED_ELSEWHERE = "resumed_elsewhere"    # another connection resumed the request: it streams there now
    SLOW_CONSUMER = "slow_consumer"
    STALLED = "stalled"                        # no output for REQUEST_STALL_S: the worker went silent
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


# Codes after which sending the same request again may succeed.
RETRYABLE = frozenset({
    ErrorCode.RATE_LIMITED, ErrorCode.CONCURRENCY_LIMIT, ErrorCode.OVERLOADED,
    ErrorCode.WORKER_LOST, ErrorCode.BACKEND_UNAVAILABLE, ErrorCode.OUTPUT_WRITE_FAILED, ErrorCode.OUTPUT_LOST,
    ErrorCode.SHUTTING_DOWN,
    ErrorCode.SLOW_CONSUMER, ErrorCode.INTERNAL,
    ErrorCode.STALLED, ErrorCode.TOO_MANY_SOCKETS,
})


class ProtocolError(Exception):
    """A client-visible error: carries a code, a message, the request id it concerns (if any),
    and `param`, the request field it is about (if one), so no caller reads it out of `message`."""

    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None, *, param: str | None = None):
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.request_id = request_id
        self.param = param

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE
