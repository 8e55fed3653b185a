"""The Responses API's answer to one request: the `Writer` its session's `Sender` writes to, as
the typed events of gateway.openai.response_events over server-sent events (`stream: true`), or
the response object as one JSON body.

A stream is fed from the request's first token (a re-attach resumes the request from seq 0), so
its events are numbered the same on every replica; the events numbered <= `skip`
(`starting_after`) are not written. The header hold of the chat stream applies (a refusal before
any token is an HTTP status): the opening `response.created` / `response.in_progress` go out with
the first token or the end.
"""

from __future__ import annotations

import json
import time

from pydantic import BaseModel
from starlette.types import Send

from gateway.openai.errors import APIError
from gateway.openai.response import OpenAIResponse
from gateway.openai.responses_store import Stored
from shared.protocol import Accepted, Chunk, Done, Error, Heartbeat


class ResponseWriter(OpenAIResponse):
    def __init__(self, send: Send, stored: Stored, *, stream: bool, skip: int = -1,
                 headers: list[tuple[bytes, bytes]] | None = None):
        super().__init__(send, oai_id=stored.base["id"], model=stored.base["model"], stream=stream,
                         include_usage=False, role_chunk=False, headers=headers)
        self.stored = stored
        self.events = stored.events()
        self.skip = skip

    def _sse(self, events: list[dict]) -> str:
        return "".join(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False, separators=(',', ':'))}\n\n"
                       for e in events if e["sequence_number"] > self.skip)

    def encode(self, msg: BaseModel) -> str:
        if isinstance(msg, Accepted):
            opening = self.events.start()
            return self._sse(opening) if self.stream else ""
        if isinstance(msg, Error):
            self.error = msg
            if not self.stream:
                return ""
            body = APIError.from_code(msg.code, msg.message).body()["error"]
            # numbered as the last event before it: `starting_after` that number misses nothing
            event = {"type": "error", "sequence_number": max(self.events.number - 1, self.skip), **body}
            return f"event: error\ndata: {json.dumps(event)}\n\n"
        return ""

    async def send(self, msg: BaseModel) -> None:
        self.last_send = time.monotonic()
        if isinstance(msg, Chunk):
            lp = [e.model_dump(exclude={"text_offset"}) for e in msg.logprobs] if msg.logprobs else None
            events = self.events.text(msg.text, lp)
            if self.stream:
                await self._write(self._sse(events), commit=True)
        elif isinstance(msg, Done):
            self.done = msg
            refused = msg.finish_reason == "error" and not self.committed and not self.events.output
            if not refused:
                u = msg.usage
                events = self.events.finish(msg.finish_reason, prompt_tokens=u.prompt_tokens,
                                            completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
                                            error=msg.error)
                if self.stream:
                    await self._write(self._sse(events), commit=True)
            # else: refused before any token (context_too_long, a schema the engine rejects): an HTTP status
            self.ended.set()
        elif isinstance(msg, Heartbeat):
            if self.stream:
                await self._write(": keep-alive\n\n", commit=True)
        else:
            await self.send_payload(self.encode(msg))

    def api_error(self) -> APIError | None:
        if self.done is not None:
            return super().api_error() if not self.events.ended else None
        return super().api_error()

    def body(self) -> tuple[int, dict]:
        error = self.api_error()
        if error is not None:
            return error.status, error.body()
        return 200, self.events.response()
