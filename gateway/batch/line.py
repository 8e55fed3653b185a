"""One batch line through the request core, on the batch lane, answered exactly once.

A line is a generate like any HTTP request's (the same body parsing, caps, admission, per-key
limits, the same session, `Sender` and non-streamed OpenAI response), with two differences:
`priority: "batch"` (the lane that yields to interactive traffic) and an idempotency key made of
the batch id, the line's index and its attempt. A replica that takes a batch over (gateway.batch
.runner) sends the line again: the key re-attaches it to the request the first replica started,
from its first token, so nothing runs twice. Its answer is recorded with HSETNX
(gateway.batch.store), so nothing is answered twice either.

`run` returns whether the line is answered. Not answered: refused before it started for a reason
that passes (rate, concurrency, overload, Redis), or cut off by this replica's drain or by
another replica taking it over; the runner tries it again later (or leaves it to the new holder).
A `/v1/responses` line is the route's turn (gateway.openai.responses_turn): the same body,
`previous_response_id` chains, the response object as its answer, stored unless `store: false`.

A request that ended with a retryable failure (worker lost, stalled, output lost) or was
cancelled without the batch being cancelled runs again under the next attempt's key, up to
MAX_ATTEMPTS; a refusal or a final failure is the answer.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass
from typing import Awaitable, Callable

from redis.exceptions import RedisError

from gateway.batch.files import RESPONSES, BatchLine
from gateway.batch.store import BatchStore
from gateway.openai import responses_body as rb
from gateway.openai import structured
from gateway.openai.errors import CANCELLED_CODE, APIError
from gateway.openai.response import CHAT_PREFIX, TEXT_PREFIX, OpenAIResponse
from gateway.openai.response_writer import ResponseWriter
from gateway.openai.responses_store import PREFIX, ResponseStore
from gateway.openai.responses_turn import prepare
from gateway.openai.schema import echo_only, parse_body
from gateway.openai.session import HttpSession
from gateway.request_core import RequestCore
from gateway.request_state import RequestState
from shared.errors import RETRYABLE, ErrorCode, ProtocolError
from shared.protocol import Generate, parse_client_message

MAX_ATTEMPTS = 3
# ended without an answer to record: another session (a replica that took the batch over) has it
NOT_AN_ANSWER = {ErrorCode.RESUMED_ELSEWHERE.value, ErrorCode.SHUTTING_DOWN.value}


async def _discard(message: dict) -> None:     # a batch line's response goes to Redis, not to a socket
    pass


@dataclass
class _Call:
    """A line's request made ready: its `generate`, and how its answer is read and kept."""
    message: Callable[..., Generate]                  # (client id, **extra fields) -> generate
    prefix: str                                       # the client id's prefix (chatcmpl-, cmpl-, resp_)
    writer: Callable[[RequestState], Awaitable[OpenAIResponse]]
    finished: Callable[[OpenAIResponse], Awaitable[None]]


async def _nothing(out: OpenAIResponse) -> None:
    pass


class LineRunner:
    def __init__(self, core: RequestCore, http_session: Callable[[], HttpSession], store: BatchStore,
                 model: str, responses: ResponseStore):
        self.core = core
        self.http_session = http_session
        self.store = store
        self.model = model
        self.responses = responses

    async def run(self, batch_id: str, key_id: str, line: BatchLine, cancelled: asyncio.Event) -> bool:
        """Run `line` of `batch_id` for `key_id` to its recorded answer (True), or give up for now
        (False). `cancelled`: the batch is being cancelled (an in-flight request is cancelled too)."""
        try:
            call = await (self._response(line, key_id) if line.url == RESPONSES else self._chat(line))
            attempt = await self.store.attempt(batch_id, line.index)
            rid = secrets.token_hex(16)
            msg = call.message(call.prefix + rid, priority="batch",
                               idempotency_key=f"{batch_id}:{line.index}:{attempt}")
        except APIError as exc:
            return await self._answer(batch_id, line, exc.status, exc.body(), rid=None)
        except (RedisError, OSError):
            return False
        session = self.http_session()
        try:
            req = await self.core.start_or_attach(session.requests, key_id, msg, rid=rid, accept=lambda r: None,
                                                  attach_as=lambda first: call.prefix + first)
        except ProtocolError as exc:
            if exc.code in RETRYABLE:
                return False
            error = APIError.from_code(exc.code, exc.message)
            return await self._answer(batch_id, line, error.status, error.body(), rid=None)
        except (RedisError, OSError):
            return False
        try:
            out = await call.writer(req)
        except (RedisError, OSError):
            session.requests.release_all()    # it runs on; the next try re-attaches to it by its key
            return False
        ended = asyncio.ensure_future(out.ended.wait())
        cancel = asyncio.ensure_future(cancelled.wait())
        try:
            session.stream(out, req, heartbeats=False)
            await asyncio.wait([ended, cancel], return_when=asyncio.FIRST_COMPLETED)
            if not ended.done():      # the batch is cancelled: so is its request (the worker stops)
                await self.core.cancel(session.requests, req, "batch")
                await ended
        finally:
            ended.cancel()
            cancel.cancel()
            await session.end()       # unfinished (a drain): parked for the replica that takes over
        if out.done is None:
            return False
        error = out.api_error()
        if error is not None and error.code in NOT_AN_ANSWER:
            return False
        # a retryable failure, or a cancel the batch did not ask for (an orphan nobody re-attached
        # to in time): the line runs again under its next attempt's key
        again = error is not None and (error.code in RETRYABLE or (error.code == CANCELLED_CODE
                                                                   and not cancelled.is_set()))
        if again and attempt + 1 < MAX_ATTEMPTS:
            await self.store.attempt(batch_id, line.index, bump=True)
            return False
        try:
            await call.finished(out)
        except (RedisError, OSError):
            pass                      # (a stored response's later poll derives it from its history)
        status, answer = out.body()
        return await self._answer(batch_id, line, status, answer, rid=req.rid)

    def _check(self, model: str | None, stream: bool) -> None:
        if model != self.model:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.model}'",
                           code="model_not_found", param="model")
        if stream:
            raise APIError(400, "'stream' is not supported in a batch (the answer goes to the output file)",
                           param="stream")

    async def _chat(self, line: BatchLine) -> _Call:
        """A chat or text completion line: the chat routes' body, answered as their non-streamed answer."""
        chat = line.url == "/v1/chat/completions"
        body, fields = parse_body(json.dumps(line.body).encode(), chat)
        self._check(body.model, body.stream)
        if (body.n or 1) > 1:
            raise APIError(400, "'n' > 1 is not supported in a batch (one request a line: send a line per choice)",
                           param="n")

        def message(client_id: str, **extra) -> Generate:
            try:
                return parse_client_message({"type": "generate", "id": client_id, **fields, **extra})
            except ProtocolError as exc:
                raise APIError(400, exc.message, code=exc.code.value) from None

        async def writer(req: RequestState) -> OpenAIResponse:
            return OpenAIResponse(_discard, oai_id=req.client_id, model=self.model, stream=False, include_usage=False,
                                  role_chunk=False, tools=structured.parser_for(body, req.rid),
                                  echo_only=echo_only(body))
        return _Call(message, CHAT_PREFIX if chat else TEXT_PREFIX, writer, _nothing)

    async def _response(self, line: BatchLine, key_id: str) -> _Call:
        """A Responses API line: the route's turn (gateway.openai.responses_turn, the stored chain
        of `previous_response_id` included), answered as the response object and stored as the
        route stores it (`store`, by default): retrievable, and a chain's next turn."""
        body = rb.parse(json.dumps(line.body).encode())
        self._check(body.model or self.model, body.stream)
        if body.background:
            raise APIError(400, "'background' is not supported in a batch (a batch runs in the background)",
                           param="background")
        turn = await prepare(self.responses, body, key_id, self.model)

        async def writer(req: RequestState) -> OpenAIResponse:
            stored = turn.stored(req.rid)          # the request that runs it (a re-attach: the first's)
            if body.store:
                await self.responses.save(stored)
            return ResponseWriter(_discard, stored, stream=False)

        async def finished(out: OpenAIResponse) -> None:
            if body.store and isinstance(out, ResponseWriter) and out.events.ended:
                await self.responses.save_final(out.stored, out.events.response())
        return _Call(turn.message, PREFIX, writer, finished)

    async def _answer(self, batch_id: str, line: BatchLine, status: int, body: dict, *, rid: str | None) -> bool:
        request_id = rid or secrets.token_hex(16)
        await self.store.record(batch_id, line.index, {
            "id": "batch_req_" + request_id, "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None},
            ok=status == 200)
        return True
