"""Starlette application: `/v1/stream` WebSocket, health/readiness, metrics, the browser page."""

from __future__ import annotations

import contextlib
import hmac
from importlib import metadata
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from gateway.auth import bearer_token
from gateway import openai_api, tokenize_api
from gateway.hub import Hub
from gateway.settings import GatewaySettings
from gateway.socket_io import (
    CLOSE_POLICY, CLOSE_SERVICE_RESTART, CLOSE_TRY_AGAIN_LATER, SHUTDOWN_REASON, ExposeTransport, FrameSocket,
)
from shared.errors import ErrorCode, ProtocolError
from shared.protocol import JSON_SUBPROTOCOL, MSGPACK_SUBPROTOCOL, error_message

STATIC_DIR = Path(__file__).parent / "static"
# The JS client SDK lives where its users look for it (clients/js); the page imports it from here.
CLIENTS_JS_DIR = Path(__file__).resolve().parent.parent / "clients" / "js"
try:
    VERSION = metadata.version("llm-stream")
except metadata.PackageNotFoundError:   # run from a checkout that was never installed
    VERSION = "0+unknown"


async def stream(ws: WebSocket) -> None:
    hub: Hub = ws.app.state.hub
    offered = ws.scope.get("subprotocols") or []
    subprotocol = next((p for p in (MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL) if p in offered), None)
    binary = subprotocol == MSGPACK_SUBPROTOCOL
    await ws.accept(subprotocol=subprotocol)
    socket = FrameSocket(ws, binary=binary, metrics=hub.metrics)
    socket.limit_send_buffer(hub.settings.socket_send_buffer)
    claim = None
    try:
        if hub.draining:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, SHUTDOWN_REASON)
        hub.origins.check(ws.headers.get("origin"), ws.headers.get("host"))
        claim = hub.socket_caps.open(ws.client.host if ws.client else "")
        presented = bearer_token(ws.headers.get("authorization")) or ws.query_params.get("api_key")
        # no key in the handshake: a browser may still send {type: "auth"} as its first message
        key_id = hub.key_checker.identify(presented) if presented or not hub.key_checker.required else None
        if key_id is not None:
            claim.identify(key_id)
    except ProtocolError as exc:
        if claim is not None:
            claim.close()
        hub.metrics.rejections.labels(exc.code.value).inc()
        # the typed error first: browsers cannot read close reasons reliably
        await socket.close(REFUSAL_CLOSE_CODES.get(exc.code, CLOSE_POLICY), exc.code.value, last=error_message(exc))
        return
    try:
        await hub.websocket_session(socket, key_id=key_id, claim=claim).run()
    finally:
        claim.close()


REFUSAL_CLOSE_CODES = {ErrorCode.SHUTTING_DOWN: CLOSE_SERVICE_RESTART, ErrorCode.TOO_MANY_SOCKETS: CLOSE_TRY_AGAIN_LATER}


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    hub: Hub = request.app.state.hub
    ok = await hub.ready()
    return JSONResponse({"ready": ok, "draining": hub.draining}, status_code=200 if ok else 503)


async def health(request: Request) -> Response:
    """`GET /health` (and `/v1/health`) as vLLM, TGI and llama.cpp serve it, which benchmark
    and load-balancer clients (guidellm among them) check before they send anything: 200 when
    this gateway can serve (it is /readyz under the name those clients know), else 503."""
    hub: Hub = request.app.state.hub
    ok = await hub.ready()
    return JSONResponse({"status": "ok" if ok else ("draining" if hub.draining else "unavailable")},
                        status_code=200 if ok else 503)


async def version(request: Request) -> Response:
    """`GET /version` in vLLM's shape."""
    return JSONResponse({"version": VERSION})


async def metrics(request: Request) -> Response:
    hub: Hub = request.app.state.hub
    if not admin_allowed(request, hub.settings.admin_token.get_secret_value()):
        return Response("admin token required (Authorization: Bearer ADMIN_TOKEN)\n", status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})
    return Response(hub.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def admin_allowed(request: Request, token: str) -> bool:
    """ADMIN_TOKEN guards the admin endpoints (/metrics: its labels name API keys and error
    rates); empty = open, e.g. when only the cluster network can reach the port."""
    if not token:
        return True
    presented = bearer_token(request.headers.get("authorization")) or ""
    return hmac.compare_digest(presented.encode(), token.encode())


async def index(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


async def favicon(request: Request) -> Response:
    """Browsers ask for /favicon.ico whatever the page says: answer it rather than log a 404."""
    return FileResponse(STATIC_DIR / "favicon.ico", media_type="image/x-icon",
                        headers={"Cache-Control": "public, max-age=86400"})


def create_app(settings: GatewaySettings | None = None) -> Starlette:
    settings = settings or GatewaySettings()
    hub = Hub(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await hub.start()
        try:
            yield
        finally:
            await hub.stop()

    app = Starlette(
        routes=[
            WebSocketRoute("/v1/stream", stream),
            *openai_api.ROUTES,
            *tokenize_api.ROUTES,
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/health", health),
            Route("/v1/health", health),
            Route("/version", version),
            Route("/metrics", metrics),
            Route("/", index),
            Route("/favicon.ico", favicon),
            Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
            Mount("/clients/js", StaticFiles(directory=CLIENTS_JS_DIR, check_dir=False), name="clients-js"),
        ],
        lifespan=lifespan,
        middleware=[Middleware(ExposeTransport)],
        # 404 / 405 under /v1 in OpenAI's error JSON (SDKs parse it); plain text elsewhere, as before
        exception_handlers={HTTPException: openai_api.http_exception},
    )
    app.state.hub = hub
    return app
