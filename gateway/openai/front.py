"""What the HTTP routes (the OpenAI API, vLLM's /tokenize) need of the gateway, and nothing more.

The composition root (gateway.hub) builds one `HttpFront` when the gateway starts, as it builds
each WebSocket's parts; a route handler finds it at `request.app.state.http`. Handlers never
see the hub: what they can reach is listed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

from starlette.requests import Request

from gateway.auth import KeyChecker, bearer_token
from gateway.batch.files import FileStore
from gateway.batch.store import BatchStore
from gateway.metrics import GatewayMetrics
from gateway.openai.errors import APIError
from gateway.openai.responses_store import ResponseStore
from gateway.openai.session import HttpSession
from gateway.request_core import RequestCore
from gateway.settings import GatewaySettings
from shared.errors import ProtocolError
from shared.events import TokenizeReply


@dataclass(frozen=True)
class HttpFront:
    core: RequestCore                                   # start_or_attach, resume, cancel, check_open
    key_checker: KeyChecker
    settings: GatewaySettings
    metrics: GatewayMetrics
    http_session: Callable[[], HttpSession]             # a new session (request table, sender, watchdogs)
    ask_worker: Callable[[str, dict], Awaitable[TokenizeReply]]  # a request/reply with a live worker (tokenize)
    responses: ResponseStore                            # stored Responses API responses
    files: FileStore                                    # the Batch API's files (gateway.batch)
    batches: BatchStore                                 # the Batch API's batch objects

    @staticmethod
    def of(request: Request) -> "HttpFront":
        return request.app.state.http

    def identify(self, request: Request) -> str:
        """The API key's id (a 401 APIError when a key is required and this one is not valid)."""
        try:
            return self.key_checker.identify(bearer_token(request.headers.get("authorization")))
        except ProtocolError as exc:
            raise APIError.from_code(exc.code, exc.message) from None

    def check_open(self) -> None:
        """The one draining check (gateway.request_core), as an HTTP 503."""
        try:
            self.core.check_open()
        except ProtocolError as exc:
            raise APIError.from_code(exc.code, exc.message) from None

    def served(self, model: str) -> str:
        name = self.settings.served_model_name
        if model != name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{name}'",
                           code="model_not_found", param="model")
        return name
