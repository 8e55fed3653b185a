"""vLLM's `POST /tokenize` and `POST /detokenize`, at the root as vLLM serves them, in its
request and response shapes (docs/clients.md), so vLLM clients work unchanged.

The gateway has no tokenizer (its image has no torch or transformers), so each request is a
small request/reply over Redis with one live worker, which answers with its engine's own
tokenizer and prompt building (worker.tokenization): a chat's ids are exactly those a generate
with the same messages and tools runs, because they are built from the same entry fields
(gateway.new_request.entry_prompt) by the same code (worker.engine.prompts.build_prompt_ids).

1. pick a live worker from the router's registry snapshot (gateway.router.Router.live);
2. subscribe a one-shot reply id on this gateway's inbox (gateway.inbox);
3. append a `tokenize` / `detokenize` entry naming the reply id and this gateway to that
   worker's control stream, only while the worker is still registered (the next one if not);
4. the worker appends its answer to our inbox as a `tokr` event for the reply id; we wait at
   most REPLY_TIMEOUT_S for it, and unsubscribe whatever happens.

Bounded: the prompt by MAX_PROMPT_CHARS (as a generate), `tokens` by as many ids, the wait by
REPLY_TIMEOUT_S, and a worker answers at most worker.control.MAX_TOKENIZING at once.
"""

from __future__ import annotations

import asyncio
import random
import secrets

from pydantic import BaseModel, ConfigDict
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.inbox import Inbox
from gateway.new_request import check_prompt_chars, entry_prompt
from gateway.openai import structured
from gateway.openai.errors import APIError
from gateway.openai.front import HttpFront
from gateway.openai.schema import _chat_messages, json_object, validated
from gateway.router import Router
from gateway.submit import Submitter
from shared.errors import ErrorCode, ProtocolError
from shared.events import TokenizeReply
from shared.protocol import parse_client_message
from shared.streams import encode_tokenize

REPLY_TIMEOUT_S = 10.0
MAX_TOKEN_ID = 2**31 - 1    # no vocabulary is larger; the worker checks its own


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None


class TokenizeCompletionBody(_Body):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatBody(_Body):
    messages: list[dict]
    add_generation_prompt: bool | None = None          # default: true, unless continue_final_message
    continue_final_message: bool = False
    add_special_tokens: bool = False                   # on top of the chat template's own
    tools: list | None = None
    return_token_strs: bool | None = False


class DetokenizeBody(_Body):
    tokens: list[int]


def _check(front: HttpFront, request: Request) -> None:
    front.identify(request)
    front.check_open()


def tokenize_fields(body: TokenizeCompletionBody | TokenizeChatBody, max_prompt_chars: int) -> dict:
    """What the worker's prompt building gets: the prompt, or the messages and tools exactly as
    a generate's request entry carries them (validated by the same code), and vLLM's options."""
    if isinstance(body, TokenizeChatBody):
        if body.continue_final_message and body.add_generation_prompt:
            raise APIError(400, "cannot set both 'continue_final_message' and 'add_generation_prompt' to true",
                           code=ErrorCode.INVALID_REQUEST.value, param="continue_final_message")
        fields = {"messages": _chat_messages(body.messages), **structured.structured_fields(body, APIError)}
        param = "messages"
    else:
        fields, param = {"prompt": body.prompt}, "prompt"
    try:
        msg = parse_client_message({"type": "generate", "id": "tokenize", **fields})
        check_prompt_chars(msg, max_prompt_chars)
    except ProtocolError as exc:
        raise APIError(400, exc.message, code=exc.code.value, param=param) from None
    prompt, messages, tools = entry_prompt(msg)
    out = {"prompt": prompt} if messages is None else {"messages": messages, "tools": tools}
    if isinstance(body, TokenizeChatBody):
        out["add_generation_prompt"] = (body.add_generation_prompt if body.add_generation_prompt is not None
                                        else not body.continue_final_message)
        out["continue_final_message"] = body.continue_final_message
        if body.add_special_tokens:             # else the template's alone, as a generate
            out["add_special_tokens"] = True
    elif not body.add_special_tokens:           # else the tokenizer's, as a generate
        out["add_special_tokens"] = False
    out["return_token_strs"] = bool(body.return_token_strs)
    return out


class WorkerAsk:
    """One request/reply with a live worker (this module's docstring), built by the composition
    root with the parts it needs; called as `ask(kind, fields)`."""

    def __init__(self, reader: Inbox, router: Router, submitter: Submitter, gw_id: str):
        self.reader = reader
        self.router = router
        self.submitter = submitter
        self.gw_id = gw_id

    async def __call__(self, kind: str, fields: dict) -> TokenizeReply:
        """One request/reply with a live worker (this module's docstring); its answer, or APIError."""
        reply_id = "tok-" + secrets.token_hex(16)
        replied: asyncio.Future = asyncio.get_running_loop().create_future()
        sub = self.reader.subscribe(reply_id, lambda ev: replied.done() or replied.set_result(ev))
        try:
            workers = await self.router.live()
            ready = [w for w in workers if w.state == "ready"] or workers
            entry = encode_tokenize(kind, reply_id, self.gw_id, fields)
            # the snapshot may list a worker that has left since: then the next one
            for worker in random.sample(ready, min(3, len(ready))):
                if await self.submitter.to_registered_worker(worker.worker_id, entry):
                    break
            else:
                raise APIError.from_code(ErrorCode.OVERLOADED, "no worker is alive to tokenize with; retry shortly")
            try:
                async with asyncio.timeout(REPLY_TIMEOUT_S):
                    answer = await replied
            except TimeoutError:
                raise APIError.from_code(ErrorCode.STALLED, f"worker {worker.worker_id} did not answer within "
                                                            f"{REPLY_TIMEOUT_S:g} s; retry") from None
        except (RedisError, OSError, TimeoutError):
            raise APIError.from_code(ErrorCode.BACKEND_UNAVAILABLE, "the backend (Redis) is unavailable") from None
        finally:
            self.reader.unsubscribe(sub)
        if answer.error is not None:
            exc = APIError.from_code(answer.error.code, answer.error.message)
            exc.param = answer.error.param
            raise exc
        return answer


async def tokenize(request: Request) -> Response:
    front = HttpFront.of(request)
    try:
        _check(front, request)
        data = json_object(await request.body())
        body = validated(TokenizeChatBody if "messages" in data else TokenizeCompletionBody, data)
        if body.model is not None:
            front.served(body.model)
        answer = await front.ask_worker("tokenize", tokenize_fields(body, front.settings.max_prompt_chars))
    except APIError as exc:
        return exc.response()
    tokens = list(answer.tokens or ())
    strs = answer.token_strs
    return JSONResponse({"count": len(tokens), "max_model_len": answer.max_model_len, "tokens": tokens,
                         "token_strs": list(strs) if strs is not None else None})


async def detokenize(request: Request) -> Response:
    front = HttpFront.of(request)
    try:
        _check(front, request)
        body = validated(DetokenizeBody, json_object(await request.body()))
        if body.model is not None:
            front.served(body.model)
        limit = front.settings.max_prompt_chars
        if len(body.tokens) > limit:
            raise APIError(400, f"{len(body.tokens)} token ids exceed {limit}", code=ErrorCode.PROMPT_TOO_LARGE.value,
                           param="tokens")
        bad = next((t for t in body.tokens if not 0 <= t <= MAX_TOKEN_ID), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of the vocabulary", code=ErrorCode.INVALID_REQUEST.value,
                           param="tokens")
        answer = await front.ask_worker("detokenize", {"tokens": body.tokens})
    except APIError as exc:
        return exc.response()
    return JSONResponse({"prompt": answer.prompt})


ROUTES = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
