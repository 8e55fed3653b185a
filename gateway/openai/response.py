"""The OpenAI response of one request: the `Writer` (gateway.writer) its session's `Sender`
writes to, as OpenAI chunk events over server-sent events (`stream: true`) or one JSON body
(`stream: false`). Every SSE event carries `id: <seq>`, which a resume names (`Last-Event-ID`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable

from pydantic import BaseModel
from starlette.types import Send

from gateway.openai import structured
from gateway.openai.choices import Choice, usage_of_all
from gateway.openai.errors import APIError, done_error
from gateway.openai.logprobs import chat_logprobs, completion_logprobs
from gateway.writer import SHUTDOWN_REASON
from shared.errors import ErrorCode
from shared.protocol import Accepted, Chunk, Done, Error, Heartbeat

log = logging.getLogger("gateway.openai")

CHAT_PREFIX, TEXT_PREFIX = "chatcmpl-", "cmpl-"


class OpenAIResponse:
    """Plays `FrameSocket` for the `Sender`: frames in, OpenAI chunk events (or one JSON body) out.

    A stream's response headers are held until its first event from the worker (a token, or the
    end), or its first heartbeat (HEARTBEAT_S), or a close (drain). So a refusal the worker makes
    before any token — a prompt over MAX_PROMPT_TOKENS (`context_too_long`: only the worker's
    tokenizer can count it; the gateway has none), a request that can never fit the KV cache —
    is an HTTP status (400), which the SDKs raise as `BadRequestError`, not a `200` stream with an
    error inside. It costs no time to first token: the headers and the role chunk go out in the
    same write as the first token (tests/test_openai_compat.py measures it)."""

    HOLD_HEADERS = True      # False: the 200 goes out at the request's acceptance (a test compares the two)

    def __init__(self, send: Send, *, oai_id: str, model: str, stream: bool, include_usage: bool,
                 role_chunk: bool, headers: list[tuple[bytes, bytes]] | None = None, tools=None,
                 prompt_tokens: Callable[[], int] | None = None, choices: dict[str, Choice] | None = None,
                 echo_only: bool = False):
        self._send = send
        # continuous usage (vLLM's stream_options.continuous_usage_stats): every chunk carries the
        # usage so far; the prompt's size is what the worker's token events said
        self.prompt_tokens = prompt_tokens
        self.tools = tools                   # a gateway.openai.tool_calls parser when the request has tools
        # `n`: each choice is a request of its own, by client id (gateway.openai.choices)
        self.choices = choices or {oai_id: Choice(0, tools)}
        self.many = len(self.choices) > 1    # SSE events carry no `id:` then (no one seq to resume from)
        self.echo_only = echo_only           # completions echo + max_tokens 0: the prompt alone
        self.oai_id = oai_id
        self.chat = oai_id.startswith(CHAT_PREFIX)
        self.model = model
        self.created = int(time.time())
        self.stream = stream
        self.include_usage = include_usage
        self.role_chunk = role_chunk and self.chat
        self.send_started: float | None = None
        self.last_send = time.monotonic()
        self.ended = asyncio.Event()
        self.broken = False                  # a write failed: the client is gone
        self.done: Done | None = None        # the first choice's, once every choice has ended
        self.error: Error | None = None
        # stream: true — the 200's headers and what was written before the first event, held
        self._start = {"type": "http.response.start", "status": 200, "headers": headers or []}
        self._held: list[str] = []
        self.committed = False               # the 200 went out: a later failure can only be an event in it

    # the Sender's interface ------------------------------------------------

    def encode(self, msg: BaseModel) -> str:
        """A control frame as the text it becomes here (the Sender queues it and counts its bytes)."""
        if isinstance(msg, Accepted):
            if not (self.stream and self.role_chunk):
                return ""
            return self._event_text(self._chunk(None, None, role=True, index=self._choice(msg.id).index), 0)
        if isinstance(msg, Error):           # e.g. the closing explanation of a drain
            self.error = msg
            return f"data: {json.dumps(APIError.from_code(msg.code, msg.message).body())}\n\n" if self.stream else ""
        return ""                            # pong and the like have no HTTP counterpart

    async def send_payload(self, payload: str) -> None:
        self.last_send = time.monotonic()
        if payload:
            await self._write(payload)

    def flush(self) -> None:
        """Nothing held: each event is its own body write."""

    async def send(self, msg: BaseModel) -> None:
        # counts as a send even when nothing is written (a heartbeat of a non-streamed answer),
        # so the Sender's heartbeat clock advances instead of firing again at once
        self.last_send = time.monotonic()
        if isinstance(msg, Chunk):
            c = self._choice(msg.id)
            c.seq = msg.seq
            text, lps = echoed(msg, self.echo_only)
            i = c.index
            if self.stream and c.tools is not None:    # text and tool call deltas
                await self._event(self._usage_so_far(self._chunk(
                    None, None, delta=structured.delta(*c.tools.feed(text)), logprobs=lps, index=i)),
                    msg.seq, commit=True)
            elif self.stream:
                await self._event(self._usage_so_far(self._chunk(text, None, logprobs=lps, index=i)),
                                  msg.seq, commit=True)
            else:
                c.parts.append(text)
                if lps is not None:
                    c.logprobs = (c.logprobs or []) + lps
        elif isinstance(msg, Done):
            c = self._choice(msg.id)
            c.done = msg
            if self.stream and (self.committed or done_error(msg) is None):
                await self._finish_choice(c, msg)
            # else: a stream refused before its first event: RunRequest answers with the status
            if all(x.done is not None for x in self.choices.values()):
                self.done = next(iter(self.choices.values())).done
                if self.stream and self.committed:
                    await self._end_stream()
                self.ended.set()
        elif isinstance(msg, Heartbeat):
            if self.stream:   # proxies see traffic; SSE clients ignore comments
                await self._write(": keep-alive\n\n", commit=True)
        else:
            await self.send_payload(self.encode(msg))

    async def close(self, code: int, reason: str, *, last: BaseModel | None = None) -> None:
        if last is not None:
            await self.send(last)
        if self.stream and not self.committed and self._held:
            await self._write("", commit=True)     # e.g. a drain's error event: the id to resume with
        self.ended.set()

    def abort(self) -> None:
        self.broken = True
        self.ended.set()

    # building events -------------------------------------------------------

    def _choice(self, client_id: str) -> Choice:
        return self.choices.get(client_id) or next(iter(self.choices.values()))

    def _chunk(self, text: str | None, finish: str | None, *, role: bool = False, logprobs: list | None = None,
               delta: dict | None = None, index: int = 0) -> dict:
        if self.chat:
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta,
                      "logprobs": chat_logprobs(logprobs) if logprobs is not None else None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "",
                      "logprobs": completion_logprobs(logprobs) if logprobs is not None else None,
                      "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.oai_id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    def _usage_so_far(self, chunk: dict) -> dict:
        if self.prompt_tokens is not None:
            prompt = self.prompt_tokens()
            completion = 0 if self.echo_only else sum(c.seq for c in self.choices.values())
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
        return chunk

    def usage(self) -> dict:
        """The whole answer's usage (every choice has ended)."""
        return usage_of_all([c.done for c in self.choices.values()], echo_only=self.echo_only)

    async def _finish_choice(self, c: Choice, done: Done) -> None:
        """One choice's end: its error event, or its last chunk with its finish_reason."""
        error = done_error(done)
        if error is not None:
            c.error_written = True
            await self._event(error.body(), done.seq, commit=True)
            return
        # what the tool-call parser held back rides in the finish chunk: all of an answer's
        # finals share the last token's id, so a client resuming there must not miss or
        # repeat a delta that came before the finish in an event of its own
        rest = structured.delta(*c.tools.finish()) if c.tools is not None else None
        last = self._chunk(None, structured.finish_reason(c.tools, done.finish_reason), delta=rest or None,
                           index=c.index)
        if self.prompt_tokens is not None and all(x.done is not None for x in self.choices.values()):
            last["usage"] = self.usage()
        await self._event(last, done.seq, commit=True)

    async def _end_stream(self) -> None:
        """Every choice has ended: a choice refused before the stream started says so now, then
        the usage chunk and `[DONE]`."""
        for c in self.choices.values():
            error = done_error(c.done)
            if error is not None and not c.error_written:
                await self._event(error.body(), c.done.seq, commit=True)
        if self.include_usage and all(done_error(c.done) is None for c in self.choices.values()):
            await self._event({**self._chunk(None, None), "choices": [], "usage": self.usage()}, self.done.seq)
        await self._write("data: [DONE]\n\n")

    def api_error(self) -> APIError | None:
        """The error the request ended with (None for an answer; `n`: the first choice's error)."""
        if self.done is not None:
            return next((e for e in (done_error(c.done or self.done) for c in self.choices.values()) if e), None)
        msg = self.error
        return APIError.from_code(msg.code if msg else ErrorCode.SHUTTING_DOWN, msg.message if msg else SHUTDOWN_REASON)

    def body(self) -> tuple[int, dict]:
        """stream: false — the status and JSON of the whole answer."""
        error = self.api_error()
        if error is not None:
            return error.status, error.body()
        choices = []
        for c in sorted(self.choices.values(), key=lambda c: c.index):
            text = "".join(c.parts)
            if self.chat:
                lp = chat_logprobs(c.logprobs) if c.logprobs is not None else None
                choices.append({"index": c.index, "message": structured.message(c.tools, text), "logprobs": lp,
                                "finish_reason": structured.finish_reason(c.tools, c.done.finish_reason)})
            else:
                lp = completion_logprobs(c.logprobs) if c.logprobs is not None else None
                choices.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.done.finish_reason})
        obj = "chat.completion" if self.chat else "text_completion"
        return 200, {"id": self.oai_id, "object": obj, "created": self.created, "model": self.model,
                     "choices": choices, "usage": self.usage()}

    # writing ----------------------------------------------------------------

    def _event_text(self, data: dict, seq: int) -> str:
        line = f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
        return line if self.many else f"id: {seq}\n{line}"

    async def _event(self, data: dict, seq: int, *, commit: bool = False) -> None:
        await self._write(self._event_text(data, seq), commit=commit)

    async def _write(self, text: str, *, commit: bool = False) -> None:
        if self.broken:
            return
        start = None
        if not self.committed:
            if not commit and self.HOLD_HEADERS:
                self._held.append(text)          # e.g. the role chunk: it goes with the first event
                return
            text = "".join(self._held) + text
            self._held.clear()
            start, self.committed = self._start, True
        self.send_started = time.monotonic()
        try:
            if start is not None:
                await self._send(start)
            if text:
                await self._send({"type": "http.response.body", "body": text.encode(), "more_body": True})
        except (OSError, RuntimeError) as exc:   # the client went away mid-write
            log.debug("SSE write failed: %r", exc)
            self.broken = True
            self.ended.set()
        finally:
            self.send_started = None
        self.last_send = time.monotonic()


def echoed(msg: Chunk, echo_only: bool) -> tuple[str, list | None]:
    """A chunk's text and logprobs as a completion shows them: the prompt first when it came
    with it (`echo`, prompt logprobs); `echo_only` (max_tokens 0): the prompt alone, without
    the one token run to get its logprobs (vLLM runs one too)."""
    text, lps = ("", None) if echo_only else (msg.text, msg.logprobs)
    if msg.prompt_text is not None:
        text = msg.prompt_text + text
    if msg.prompt_logprobs is not None:
        lps = msg.prompt_logprobs + (lps or [])
    return text, lps

