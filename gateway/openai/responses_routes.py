"""The OpenAI Responses API (docs/clients.md, "Responses API"): `POST /v1/responses`,
`GET /v1/responses/{id}` (a poll, or with `stream=true&starting_after=N` a re-attach),
`POST /v1/responses/{id}/cancel`, `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`.

A response is a request of the one request core, run as a chat request
(gateway.openai.responses_body), written as the Responses API's events
(gateway.openai.response_writer) and stored (gateway.openai.responses_store) under the id
`resp_<request id>`. A background response runs with nobody attached: its request's meta says
so (`bg`), and no orphan sweep on any replica cancels it; its client polls or re-attaches on any
replica, where the stream replays from the request's first token and skips what it had.
"""

from __future__ import annotations

import secrets

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.openai import responses_body as rb
from gateway.openai.errors import APIError
from gateway.openai.front import HttpFront
from gateway.openai.response_writer import ResponseWriter
from gateway.openai.responses_store import PREFIX, ResponseStore, Stored
from gateway.openai.responses_turn import FINISHED, prepare
from gateway.openai.session import RunRequest
from shared.errors import ErrorCode, ProtocolError
from shared.protocol import Resume


class ResponsesRun(RunRequest):
    """RunRequest with the Responses API's writer; a stored response's finished object is kept."""

    def __init__(self, *args, stored: Stored, store: ResponseStore | None, skip: int = -1, **kwargs):
        super().__init__(*args, **kwargs)
        self.stored, self.store, self.skip = stored, store, skip

    def writer(self, send: Send, headers: list[tuple[bytes, bytes]]) -> ResponseWriter:
        return ResponseWriter(send, self.stored, stream=self.stream, skip=self.skip, headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)
        if self.store is not None and self.out is not None and self.out.events.ended and self.stored.final is None:
            try:
                await self.store.save_final(self.stored, self.out.events.response())
            except (RedisError, OSError):
                pass      # a later poll derives it from the request's history


def _not_found(resp_id: str) -> APIError:
    return APIError(404, f"Response with id '{resp_id}' not found.", code="not_found", param="response_id")


def _backend() -> APIError:
    return APIError.from_code(ErrorCode.BACKEND_UNAVAILABLE, "the backend (Redis) is unavailable")


async def create(request: Request) -> Response:
    front = HttpFront.of(request)
    store = front.responses
    try:
        key_id = front.identify(request)
        front.check_open()
        body = rb.parse(await request.body())
        model = front.served(body.model or front.settings.served_model_name)
        try:
            turn = await prepare(store, body, key_id, model)
            rid = secrets.token_hex(16)
            stored = turn.stored(rid)
            msg = turn.message(PREFIX + rid)
            if body.store:
                await store.save(stored)          # before it starts: a poll finds it at once
            if body.background:
                await store.submitter.mark_background(rid)    # before it starts: never an orphan
            session = front.http_session()
            try:
                req = await front.core.start_or_attach(session.requests, key_id, msg, rid=rid, accept=lambda r: None)
            except ProtocolError as exc:
                front.metrics.rejections.labels(exc.code.value).inc()
                raise APIError.from_code(exc.code, exc.message) from None
        except (RedisError, OSError):
            raise _backend() from None
    except APIError as exc:
        return exc.response()
    if body.background and not body.stream:
        session.requests.release_all()       # nobody attached: it runs on, polled or re-attached later
        return JSONResponse(stored.events().response())
    return ResponsesRun(session, req, front.core, model=model, stream=body.stream, include_usage=False,
                        resumable=body.background, stored=stored, store=store if body.store else None)


async def _stored(request: Request) -> tuple[HttpFront, str, Stored]:
    front = HttpFront.of(request)
    key_id = front.identify(request)
    resp_id = request.path_params["id"]
    try:
        stored = await front.responses.load(resp_id, key_id)
    except (RedisError, OSError):
        raise _backend() from None
    if stored is None:
        raise _not_found(resp_id)
    return front, key_id, stored


async def retrieve(request: Request) -> Response:
    try:
        front, key_id, stored = await _stored(request)
        if request.query_params.get("stream", "").lower() not in ("1", "true"):
            try:
                return JSONResponse(await front.responses.current(stored))
            except (RedisError, OSError):
                raise _backend() from None
        if not stored.base.get("background"):
            raise APIError(400, "only a background response can be streamed again", param="stream")
        raw = request.query_params.get("starting_after", "-1")
        if not raw.lstrip("-").isdigit():
            raise APIError(400, f"starting_after {raw!r} is not an integer", param="starting_after")
        front.check_open()
        session = front.http_session()
        msg = Resume(id=PREFIX + stored.hex, last_seq=0, request_id=stored.hex)   # replayed from its first token
        try:
            req = await front.core.resume(session.requests, key_id, msg, accept=lambda r: None)
        except ProtocolError as exc:
            raise APIError.from_code(exc.code, exc.message) from None
        except (RedisError, OSError):
            raise _backend() from None
    except APIError as exc:
        return exc.response()
    return ResponsesRun(session, req, front.core, model=stored.base["model"], stream=True, include_usage=False,
                        resumable=True, stored=stored, store=front.responses, skip=int(raw))


async def cancel(request: Request) -> Response:
    try:
        front, _, stored = await _stored(request)
        if not stored.base.get("background"):
            raise APIError(400, "Only responses created with background=true can be cancelled", param="response_id")
        try:
            current = await front.responses.current(stored)
            if current["status"] not in FINISHED:
                await front.responses.cancel(stored)
                current = await front.responses.current(stored)
        except (RedisError, OSError):
            raise _backend() from None
    except APIError as exc:
        return exc.response()
    return JSONResponse(current)


async def delete(request: Request) -> Response:
    try:
        front, _, stored = await _stored(request)
        try:
            await front.responses.delete(stored)
        except (RedisError, OSError):
            raise _backend() from None
    except APIError as exc:
        return exc.response()
    return JSONResponse({"id": PREFIX + stored.hex, "object": "response", "deleted": True})


async def input_items(request: Request) -> Response:
    try:
        _, _, stored = await _stored(request)
        q = request.query_params
        order = q.get("order", "desc")
        raw_limit = q.get("limit", "20")
        if order not in ("asc", "desc"):
            raise APIError(400, "order must be 'asc' or 'desc'", param="order")
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
            raise APIError(400, "limit must be 1 to 100", param="limit")
    except APIError as exc:
        return exc.response()
    items = stored.input if order == "asc" else stored.input[::-1]
    after = q.get("after")
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:int(raw_limit)]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})


ROUTES = [
    Route("/v1/responses", create, methods=["POST"]),
    Route("/v1/responses/{id}", retrieve, methods=["GET"]),
    Route("/v1/responses/{id}", delete, methods=["DELETE"]),
    Route("/v1/responses/{id}/cancel", cancel, methods=["POST"]),
    Route("/v1/responses/{id}/input_items", input_items, methods=["GET"]),
]
