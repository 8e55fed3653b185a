"""OpenAI-compatible HTTP API: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, and a
resumable server-sent-event stream `/v1/streams/{id}` (docs/clients.md).

The handlers only translate. A request goes through the very lifecycle of a WebSocket one, over
the one request core (gateway.request_core: start or re-attach, resume, cancel, the draining
refusal), in a session the composition root builds (gateway.openai.session), whose `Sender`
writes to the OpenAI response (gateway.openai.response).

* Every SSE event carries `id: <seq>`; reconnecting to `GET /v1/streams/{id}` (any replica,
  same API key) with `Last-Event-ID: <seq>` continues exactly after it, as a WebSocket `resume`.
  The response `id` is `chatcmpl-<request_id>` / `cmpl-<request_id>`: the server request id a
  resume must present is in it.
* A client that disconnects cancels its request at once — unless it asked for `"resumable":
  true`, in which case the request waits `RESUME_GRACE_S` for a reconnect, as a dropped socket.
* Errors have OpenAI's shape (gateway.openai.errors). A parameter is used, accepted and ignored
  (it cannot change the answer), or refused with 400 unless it has its neutral value (it would
  change the answer): gateway.openai.schema, listed in docs/clients.md's compatibility table,
  which a test walks.
* A stream's headers wait for its first event, so a refusal by the worker before any token
  (`context_too_long`) is an HTTP status, not an error event in a 200 (`OpenAIResponse`).
"""

from __future__ import annotations

import secrets

from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.openai import structured
from gateway.openai.errors import APIError
from gateway.openai.front import HttpFront
from gateway.openai.response import CHAT_PREFIX, TEXT_PREFIX
from gateway.openai.choices import Choice, seed_of
from gateway.openai.schema import echo_only, parse_body
from gateway.openai.session import HttpSession, RunRequest, cancel_all
from gateway.request_state import RequestState
from shared.errors import ErrorCode, ProtocolError
from shared.protocol import Resume, parse_client_message


async def _generate(request: Request, chat: bool) -> Response:
    front = HttpFront.of(request)
    try:
        key_id = front.identify(request)
        front.check_open()
        body, fields = parse_body(await request.body(), chat)
        model = front.served(body.model)
        n = body.n or 1
        if n > front.settings.max_n:
            raise APIError(400, f"'n' must be at most {front.settings.max_n} (MAX_N)", param="n",
                           code=ErrorCode.INVALID_REQUEST.value)
        if n > 1 and body.resumable:
            raise APIError(400, "'resumable' takes one choice: a stream of several has no one seq to resume "
                                "from (send one request per choice instead)", param="resumable",
                           code=ErrorCode.INVALID_REQUEST.value)
        # the response id names the server request id, which a resume must present
        rid = secrets.token_hex(16)
        prefix = CHAT_PREFIX if chat else TEXT_PREFIX
        session = front.http_session()
        reqs = await _start_choices(front, session, key_id, fields, n, rid, prefix,
                                    request.headers.get("idempotency-key"))
    except APIError as exc:
        return exc.response()
    stream_options = body.stream_options or {}
    return RunRequest(session, reqs, front.core, model=model, stream=body.stream,
                      include_usage=bool(stream_options.get("include_usage")), resumable=body.resumable,
                      choices={r.client_id: Choice(i, structured.parser_for(body, r.rid)) for i, r in enumerate(reqs)},
                      continuous_usage=bool(stream_options.get("continuous_usage_stats")), echo_only=echo_only(body))


async def _start_choices(front: HttpFront, session: HttpSession, key_id: str, fields: dict, n: int, rid: str,
                         prefix: str, idempotency_key: str | None) -> list[RequestState]:
    """One request per choice (gateway.openai.choices): choice i is `<prefix><rid>:i` (the first
    is the answer's id), seeded seed + i, idempotent under `<key>:i`. A choice that cannot start
    cancels those that did: the answer is all its choices or an error."""
    reqs: list[RequestState] = []
    try:
        for i in range(n):
            cid = prefix + rid + (f":{i}" if i else "")
            choice = {**fields, "seed": seed_of(fields.get("seed"), i)}
            if idempotency_key is not None:
                choice["idempotency_key"] = idempotency_key + (f":{i}" if i else "")
            try:
                msg = parse_client_message({"type": "generate", "id": cid, **choice})
            except ProtocolError as exc:
                param = "Idempotency-Key" if exc.param == "idempotency_key" else exc.param
                raise APIError(400, exc.message, code=exc.code.value, param=param) from None
            try:
                # the same Idempotency-Key started it: the same answer, under that request's id
                reqs.append(await front.core.start_or_attach(
                    session.requests, key_id, msg, rid=rid if i == 0 else secrets.token_hex(16),
                    accept=lambda r: None,      # accepted by RunRequest
                    attach_as=lambda first, i=i: prefix + first + (f":{i}" if i else "")))
            except ProtocolError as exc:
                front.metrics.rejections.labels(exc.code.value).inc()
                raise APIError.from_code(exc.code, exc.message, exc.param) from None
            except (RedisError, OSError):
                raise APIError.from_code(ErrorCode.BACKEND_UNAVAILABLE, "the backend (Redis) is unavailable") from None
    except APIError:
        if reqs:
            await cancel_all(front.core, session, reqs)
            session.requests.release_all()
        raise
    return reqs


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def resume_stream(request: Request) -> Response:
    """`GET /v1/streams/{id}` with `Last-Event-ID: <seq>`: the rest of a stream, after that seq."""
    front = HttpFront.of(request)
    oai_id = request.path_params["id"]
    try:
        key_id = front.identify(request)
        front.check_open()
        if not oai_id.startswith((CHAT_PREFIX, TEXT_PREFIX)):
            raise APIError(404, f"no stream {oai_id!r}", code=ErrorCode.RESUME_EXPIRED.value)
        raw_seq = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
        if not raw_seq.isdigit():
            raise APIError(400, f"Last-Event-ID {raw_seq!r} is not a seq (a non-negative integer)",
                           param="Last-Event-ID")
        try:
            msg = Resume(id=oai_id, last_seq=int(raw_seq), request_id=oai_id.split("-", 1)[1])
        except ValidationError:   # not even shaped like a request id: the same answer as an unknown one
            raise APIError.from_code(ErrorCode.RESUME_EXPIRED, f"no retained output for {oai_id!r}") from None
        session = front.http_session()
        try:
            req = await front.core.resume(session.requests, key_id, msg, accept=lambda r: None)   # by RunRequest
        except ProtocolError as exc:
            raise APIError.from_code(exc.code, exc.message) from None
        except (RedisError, OSError):
            raise APIError.from_code(ErrorCode.BACKEND_UNAVAILABLE, "the backend (Redis) is unavailable") from None
        try:
            # an answer read for tool calls (its meta's mode, read by the resume): its parser
            # picks up where the client's left off
            read = await front.core.text_through(req.rid, msg.last_seq) if req.tool_mode else ""
        except (RedisError, OSError):
            session.requests.release_all()
            raise APIError.from_code(ErrorCode.BACKEND_UNAVAILABLE, "the backend (Redis) is unavailable") from None
        tools = structured.resumed_parser(req.tool_mode, read, req.rid)
    except APIError as exc:
        return exc.response()
    include_usage = request.query_params.get("include_usage", "").lower() in ("1", "true")
    return RunRequest(session, req, front.core, model=front.settings.served_model_name, stream=True,
                      include_usage=include_usage, resumable=True, tools=tools)


def _model_object(front: HttpFront) -> dict:
    return {"id": front.settings.served_model_name, "object": "model", "created": 0, "owned_by": "llm-stream"}


async def models(request: Request) -> Response:
    front = HttpFront.of(request)
    try:
        front.identify(request)
    except APIError as exc:
        return exc.response()
    return JSONResponse({"object": "list", "data": [_model_object(front)]})


async def model(request: Request) -> Response:
    """`GET /v1/models/{id}` (`client.models.retrieve`): the served model, or 404 model_not_found."""
    front = HttpFront.of(request)
    try:
        front.identify(request)
        front.served(request.path_params["model"])
    except APIError as exc:
        return exc.response()
    return JSONResponse(_model_object(front))


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{model:path}", model, methods=["GET"]),
    Route("/v1/streams/{id}", resume_stream, methods=["GET"]),
]
