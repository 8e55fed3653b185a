"""Starlette application: the routes of both transports (`/v1/stream`: gateway.ws.endpoint; the
OpenAI API and /tokenize: gateway.openai), health/readiness, metrics, the browser page.

The hub (gateway.hub, the composition root) is built here and started by the lifespan, which
then puts what the endpoints reach in the app's state: `websocket` (gateway.ws.endpoint's
front), `http` (gateway.openai.front's), and `probe` (gateway.probe, for tests and operations).
"""

from __future__ import annotations

import contextlib
import hmac
from importlib import metadata
from pathlib import Path

from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from gateway.auth import bearer_token
from gateway.batch import routes as batch_routes
from gateway.hub import Hub
from gateway.openai import responses_routes, routes as openai_routes, tokenize
from gateway.openai.errors import http_exception
from gateway.settings import GatewaySettings
from gateway.ws.endpoint import stream
from gateway.ws.socket import ExposeTransport

STATIC_DIR = Path(__file__).parent / "static"
# The JS client SDK lives where its users look for it (clients/js); the page imports it from here.
CLIENTS_JS_DIR = Path(__file__).resolve().parent.parent / "clients" / "js"
try:
    VERSION = metadata.version("llm-stream")
except metadata.PackageNotFoundError:   # run from a checkout that was never installed
    VERSION = "0+unknown"


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    hub: Hub = request.app.state.hub
    ok = await hub.ready()
    return JSONResponse({"ready": ok, "draining": hub.draining}, status_code=200 if ok else 503)


async def health(request: Request) -> Response:
    """`GET /health` (and `/v1/health`) as vLLM, TGI and llama.cpp serve it, which benchmark
    and load-balancer clients (guidellm among them) check before they send anything: 200 when a
    request sent now would be served, else 503. That is /readyz (this gateway: Redis, its inbox,
    not draining) and a live worker (admission's registry snapshot, cached `ADMISSION_CACHE_MS`):
    vLLM's /health answers only once its engine is up, and a client that starts as soon as it
    sees 200 (guidellm right after the stack starts, while the model still loads) would
    otherwise get 503 `overloaded` for every request. /readyz leaves workers out on purpose: a
    gateway with none still answers each request with a typed error, where an unready one
    would be taken out of its load balancer."""
    hub: Hub = request.app.state.hub
    if not await hub.ready():
        return JSONResponse({"status": "draining" if hub.draining else "unavailable"}, status_code=503)
    try:
        workers = (await hub.admission.backlog()).live_workers
    except (RedisError, OSError):
        return JSONResponse({"status": "unavailable"}, status_code=503)
    if not workers:
        return JSONResponse({"status": "unavailable", "reason": "no worker is alive to serve requests yet"},
                            status_code=503)
    return JSONResponse({"status": "ok"})


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
        app.state.websocket, app.state.http, app.state.probe = hub.websocket, hub.http, hub.probe
        try:
            yield
        finally:
            await hub.stop()

    app = Starlette(
        routes=[
            WebSocketRoute("/v1/stream", stream),
            *openai_routes.ROUTES,
            *responses_routes.ROUTES,
            *batch_routes.ROUTES,
            *tokenize.ROUTES,
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
        exception_handlers={HTTPException: http_exception},
    )
    app.state.hub = hub
    return app
