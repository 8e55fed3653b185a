"""`/v1/stream`: the WebSocket handshake (subprotocol, origin, socket caps, the key if presented)
and the hand-over to a `Connection` the composition root builds for the socket.

A refusal at the handshake is a typed `error` frame, then a close: browsers cannot read close
reasons reliably. What the endpoint can reach is `WebSocketFront`, built by the composition
root (gateway.hub) and found at `ws.app.state.websocket`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from starlette.websockets import WebSocket

from gateway.auth import KeyChecker, OriginPolicy, bearer_token
from gateway.metrics import GatewayMetrics
from gateway.request_core import RequestCore
from gateway.settings import GatewaySettings
from gateway.writer import CLOSE_POLICY, CLOSE_SERVICE_RESTART, CLOSE_TRY_AGAIN_LATER
from gateway.ws.connection import Connection
from gateway.ws.socket import FrameSocket
from gateway.ws.socket_caps import SocketCaps, SocketClaim
from shared.errors import ErrorCode, ProtocolError
from shared.protocol import JSON_SUBPROTOCOL, MSGPACK_SUBPROTOCOL, error_message

REFUSAL_CLOSE_CODES = {ErrorCode.SHUTTING_DOWN: CLOSE_SERVICE_RESTART, ErrorCode.TOO_MANY_SOCKETS: CLOSE_TRY_AGAIN_LATER}


@dataclass(frozen=True)
class WebSocketFront:
    core: RequestCore                 # the one draining check
    key_checker: KeyChecker
    origins: OriginPolicy
    socket_caps: SocketCaps
    settings: GatewaySettings
    metrics: GatewayMetrics
    # the socket's parts (dispatch, request table, sender), as the composition root builds them
    websocket_session: Callable[..., Connection]


async def stream(ws: WebSocket) -> None:
    front: WebSocketFront = ws.app.state.websocket
    offered = ws.scope.get("subprotocols") or []
    subprotocol = next((p for p in (MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL) if p in offered), None)
    binary = subprotocol == MSGPACK_SUBPROTOCOL
    await ws.accept(subprotocol=subprotocol)
    socket = FrameSocket(ws, binary=binary, metrics=front.metrics)
    socket.limit_send_buffer(front.settings.socket_send_buffer)
    claim: SocketClaim | None = None
    try:
        front.core.check_open()
        front.origins.check(ws.headers.get("origin"), ws.headers.get("host"))
        claim = front.socket_caps.open(ws.client.host if ws.client else "")
        presented = bearer_token(ws.headers.get("authorization")) or ws.query_params.get("api_key")
        # no key in the handshake: a browser may still send {type: "auth"} as its first message
        key_id = front.key_checker.identify(presented) if presented or not front.key_checker.required else None
        if key_id is not None:
            claim.identify(key_id)
    except ProtocolError as exc:
        if claim is not None:
            claim.close()
        front.metrics.rejections.labels(exc.code.value).inc()
        # the typed error first: browsers cannot read close reasons reliably
        await socket.close(REFUSAL_CLOSE_CODES.get(exc.code, CLOSE_POLICY), exc.code.value, last=error_message(exc))
        return
    try:
        await front.websocket_session(socket, key_id=key_id, claim=claim).run()
    finally:
        claim.close()
