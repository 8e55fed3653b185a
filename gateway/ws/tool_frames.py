"""Typed tool-call frames on the WebSocket (docs/protocol.md, "Tool calls"): for a request with
`tools`, the calls the model writes are read out of its text by the OpenAI API's parser
(gateway.openai.tool_calls) and sent as `tool_call` (a call started: index, call_id, name),
`tool_call_delta` (a fragment of its arguments) and `tool_call_done` (its whole arguments),
so an agent sees "calling get_weather" as an event, not as text to parse. The chunks still
carry all the text: `seq`, resume and the SDKs are unchanged.

Exact across a resume, on any replica:
* the frames a chunk's text gives go out just *before* that chunk, with its `seq`, so a client
  that has chunk S has every frame of the text up to token S;
* a resume after `last_seq` L primes a fresh parser with the text up to token L (read from the
  request's history: RequestCore.text_through, as the SSE resume does) and sends only what
  follows. The parser's output depends on the text alone, not on how it was cut into chunks,
  and call ids derive from the request id (gateway.openai.structured.resumed_parser);
* what only the end tells (a call's last characters — a `}` that could not be told from the
  JSON's own end — and its completion) goes out before `done` as `tool_call_done` with the
  whole arguments (and `tool_call` for a call only the end revealed), never as a delta; a
  client that resumes holding everything but `done` gets those again and knows them by `index`.
The tool mode of a resumed request comes from its meta (META_TOOLS, written at submit).
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

from pydantic import BaseModel
from redis.exceptions import RedisError

from gateway.openai.structured import resumed_parser
from shared.protocol import Chunk, Done, ToolCallDelta, ToolCallDone, ToolCallStart

log = logging.getLogger("gateway.connection")

TextThrough = Callable[[str, int], Awaitable[str]]     # (rid, seq) -> the output's text through token seq


class _Calls:
    """One request's calls as frames."""

    def __init__(self, client_id: str, rid: str, mode: str, prime: int):
        self.client_id = client_id
        self.rid = rid
        self.mode = mode
        self.parser = resumed_parser(mode, "", rid)
        self.prime = prime                   # tokens the client has: read from the history first
        self.done: set[int] = set()

    def primed(self, text: str) -> None:
        """The client has the frames of `text` (the output through token `prime`)."""
        self.parser = resumed_parser(self.mode, text, self.rid)
        self.done.update(c.index for c in self.parser.closed_calls())
        self.prime = 0

    def step(self, seq: int, text: str) -> list[BaseModel]:
        _, deltas = self.parser.feed(text)
        frames: list[BaseModel] = []
        for d in deltas:
            call = self.parser.calls[d["index"]]
            if "id" in d:
                frames.append(ToolCallStart(id=self.client_id, seq=seq, index=call.index, call_id=call.id,
                                            name=call.name))
            if d["function"].get("arguments"):
                frames.append(ToolCallDelta(id=self.client_id, seq=seq, index=call.index,
                                            arguments=d["function"]["arguments"]))
        return frames + self._closed(seq, self.parser.closed_calls())

    def end(self, seq: int) -> list[BaseModel]:
        _, deltas = self.parser.finish()
        frames: list[BaseModel] = [
            ToolCallStart(id=self.client_id, seq=seq, index=d["index"], call_id=d["id"], name=d["function"]["name"])
            for d in deltas if "id" in d]
        return frames + self._closed(seq, self.parser.calls)

    def _closed(self, seq: int, calls) -> list[BaseModel]:
        frames: list[BaseModel] = []
        for call in calls:
            if call.index not in self.done:
                self.done.add(call.index)
                frames.append(ToolCallDone(id=self.client_id, seq=seq, index=call.index, call_id=call.id,
                                           name=call.name, arguments=call.arguments))
        return frames


class ToolFrames:
    """A socket's requests with tools; `frames(msg)` before each of their chunks and `done`."""

    def __init__(self, text_through: TextThrough):
        self.text_through = text_through
        self.calls: dict[str, _Calls] = {}

    def track(self, client_id: str, rid: str, mode: str | None, *, after_seq: int = 0) -> None:
        """Read calls out of request `rid` (this socket's `client_id`), from token `after_seq` on."""
        if mode is None:
            self.calls.pop(client_id, None)
        else:
            self.calls[client_id] = _Calls(client_id, rid, mode, after_seq)

    async def frames(self, msg: Chunk | Done) -> list[BaseModel]:
        calls = self.calls.get(msg.id)
        if calls is None:
            return []
        if isinstance(msg, Done):
            del self.calls[msg.id]
            if msg.finish_reason == "error":      # not an end of the answer (moved elsewhere, lost, failed)
                return []
        if calls.prime and not await self._prime(calls):
            return []
        return calls.step(msg.seq, msg.text) if isinstance(msg, Chunk) else calls.end(msg.seq)

    async def _prime(self, calls: _Calls) -> bool:
        try:
            text = await self.text_through(calls.rid, calls.prime)
        except (RedisError, OSError) as exc:     # no frames rather than wrong ones; the chunks carry the text
            log.warning("tool frames of %s after a resume: history unreadable (%s)", calls.rid, exc)
            self.calls.pop(calls.client_id, None)
            return False
        calls.primed(text)
        return True
