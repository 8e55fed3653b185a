"""uvicorn wiring: WebSocket ping/timeout from settings, and a drain before uvicorn's own shutdown.

uvicorn's shutdown closes every WebSocket with 1012 at once and gives the application no say;
`GatewayServer.shutdown` first stops listening, then drains the gateway (gateway.probe's
`drain`: each client gets a typed SHUTTING_DOWN error and a close reason telling it to reconnect
and `resume`), and only then hands over to uvicorn.
"""

from __future__ import annotations

import uvicorn

from gateway.app import create_app
from gateway.settings import GatewaySettings


def build_config(settings: GatewaySettings, app=None, *, port: int | None = None) -> uvicorn.Config:
    return uvicorn.Config(
        app or create_app(settings),
        host=settings.gateway_host,
        port=settings.gateway_port if port is None else port,
        ws="websockets-sansio",
        ws_max_size=settings.ws_max_size_bytes,
        ws_per_message_deflate=settings.ws_per_message_deflate,
        # protocol-level pings: browsers answer them without any JS, so they detect dead clients
        # end to end, through proxies. Each costs a send and a receive per socket, so they go out
        # less often than heartbeats (WS_PING_S), which alone keep proxies from idling out.
        ws_ping_interval=settings.ws_ping_s if settings.ws_ping_s > 0 else None,
        ws_ping_timeout=settings.ping_timeout_s if settings.ping_timeout_s > 0 and settings.ws_ping_s > 0 else None,
        lifespan="on",
        log_level="warning",
        timeout_graceful_shutdown=10,
    )


class GatewayServer(uvicorn.Server):
    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:
            server.close()
        app = self.config.loaded_app
        probe = _find_probe(app)
        if probe is not None:
            await probe.drain()
        await super().shutdown(sockets)


def _find_probe(app):
    # uvicorn wraps the app in middleware proxies; follow `.app` down to the Starlette instance
    for _ in range(8):
        state = getattr(app, "state", None)
        if state is not None and hasattr(state, "probe"):
            return state.probe
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None
