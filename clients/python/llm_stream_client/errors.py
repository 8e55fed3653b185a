"""Typed exceptions of the client SDK. Switch on the class (or `code`), never on the message.

Retryable failures of the transport (a dropped socket, a gateway restart) never reach the
caller: the client reconnects and resumes by itself. What does reach the caller:

* `RequestRefused` — the server refused a `generate` (or a `resume`); nothing runs for it.
  `retryable` says whether sending it again later may succeed (`rate_limited`, `overloaded`...).
* `GenerationFailed` — the request ran and ended with `finish_reason: "error"`; `retryable`
  tells whether a new `generate` may succeed (`worker_lost`...). Retrying is the caller's call.
* `ResumeExpired` — the server no longer retains the request's output (a reconnect came too
  late); the text received so far is all there will be.
* `Unauthorized` — wrong or missing API key, or a browser origin that is not allowed (1008).
* `ConnectionLost` — the client gave up reconnecting after `max_reconnect_attempts`.
"""

from __future__ import annotations


class LLMStreamError(Exception):
    """Base class: `code` is the server's error code (docs/protocol.md), `retryable` its flag."""

    def __init__(self, code: str, message: str, *, retryable: bool = False, id: str | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable
        self.id = id


class RequestRefused(LLMStreamError):
    """An `error` frame for this request: it was not started (or not resumed)."""


class ResumeExpired(RequestRefused):
    """Nothing is retained for the request any more; it cannot be continued."""


class GenerationFailed(LLMStreamError):
    """`done` with `finish_reason: "error"`; the text streamed before it is still valid."""


class Unauthorized(LLMStreamError):
    """The socket was refused (`unauthorized` / `origin_not_allowed`, close 1008); not retried."""


class ConnectionLost(LLMStreamError):
    """Reconnecting failed `max_reconnect_attempts` times in a row."""
