"""What the one `Sender` writes to: a `Writer`, which a WebSocket (gateway.ws.socket.FrameSocket)
and an OpenAI HTTP response (gateway.openai.response.OpenAIResponse) both implement.

The sender deals in `shared/protocol.py` models only; a writer turns each into what its
transport sends (a WebSocket frame; an SSE event or part of one JSON body), times its sends for
the slow-consumer watchdog, and closes. The close codes and the drain's reason live here too:
both transports and the sessions' drain name them.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel

CLOSE_POLICY = 1008
CLOSE_INTERNAL_ERROR = 1011
CLOSE_SERVICE_RESTART = 1012
CLOSE_TRY_AGAIN_LATER = 1013
SHUTDOWN_REASON = "server restarting: reconnect and resume"

Payload = str | bytes


class Writer(Protocol):
    send_started: float | None      # monotonic start of the send in progress (None: no send blocked)
    last_send: float                # monotonic end of the last send (heartbeats are due from it)

    def encode(self, msg: BaseModel) -> Payload:
        """A control frame as the payload it becomes (queued and counted by the sender)."""

    async def send(self, msg: BaseModel) -> None:
        """Encode and send one message (a chunk, a `done`, a heartbeat, ...)."""

    async def send_payload(self, payload: Payload) -> None:
        """Send what `encode` made."""

    def flush(self) -> None:
        """The end of a sender pass: what it sent leaves now (a WebSocket holds the frames of
        a pass to send them in one write: gateway.ws.socket)."""

    async def close(self, code: int, reason: str, *, last: BaseModel | None = None) -> None:
        """Send `last` (the typed explanation), then end the transport."""
