"""The Responses API's event sequence of one response (`response.created` ... `response.completed`),
a pure function of the response's fixed fields and its output text and end.

Why pure: a client re-attaches to a response with `starting_after=N` on any replica, and must
get exactly the events after its event N. So the events may depend on nothing a replica or a
moment decides: not on how the gateway's flusher cut the tokens into chunks (time-based), not on
random ids. Here
* the text is cut into deltas by the text alone (`TextPieces`: its first character, then a
  piece ends after a blank, or at PIECE_CHARS characters), so any chunking of the same text
  gives the same deltas;
* item and call ids are derived from the response id and the item's index;
* `created_at` and every request field come from the stored response (`base`).
A re-attach replays the request's history from its first token through a fresh
`ResponseEvents` and skips the events numbered <= N (gateway.openai.response_writer).

Logprobs (`include: ["message.output_text.logprobs"]`) are per token, and tokens do not align
with the pieces: the deltas carry none, `output_text.done`, the finished part and the stored
response carry them all.
"""

from __future__ import annotations

import copy
from typing import Any

from gateway.openai.tool_calls import ToolCallParser

PIECE_CHARS = 24
_BLANKS = " \t\r\n"


class TextPieces:
    """Text fed in any pieces -> deltas that depend on the text only: the first is the first
    character (the first token is not held back: time to first token), then each ends at the
    first blank (included) or at PIECE_CHARS characters; the rest waits for more text or `finish`."""

    def __init__(self) -> None:
        self.buf = ""
        self.started = False

    def feed(self, text: str) -> list[str]:
        self.buf += text
        out = []
        if not self.started and self.buf:
            self.started = True
            out.append(self.buf[0])
            self.buf = self.buf[1:]
        while True:
            cut = next((i + 1 for i, ch in enumerate(self.buf[:PIECE_CHARS]) if ch in _BLANKS), None)
            if cut is None and len(self.buf) >= PIECE_CHARS:
                cut = PIECE_CHARS
            if cut is None:
                return out
            out.append(self.buf[:cut])
            self.buf = self.buf[cut:]

    def finish(self) -> list[str]:
        rest, self.buf = self.buf, ""
        return [rest] if rest else []


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseEvents:
    """Feed `start()`, then the output text (`text`, any pieces) and its logprob entries, then
    `finish(...)`; each returns the events to send, numbered from 0 (`sequence_number`)."""

    def __init__(self, base: dict, *, tool_mode: str | None = None, logprobs: bool = False):
        self.base = base                      # the response's fixed fields (id, created_at, model, params)
        self.hex = base["id"].removeprefix("resp_")
        self.parser = ToolCallParser(tool_mode, call_id=lambda i: f"call_{self.hex}_{i}") if tool_mode else None
        self.pieces = TextPieces()
        self.logprobs: list[dict] | None = [] if logprobs else None
        self.number = 0
        self.output: list[dict] = []
        self._msg: dict | None = None         # the message item being written
        self._call: dict | None = None        # the function call item being written
        self._calls: dict[int, dict] = {}     # parser call index -> its item
        self.status = "queued" if base.get("background") else "in_progress"
        self.usage: dict | None = None
        self.error: dict | None = None
        self.incomplete: dict | None = None
        self.ended = False

    # ---- the response object -------------------------------------------------------------

    def response(self) -> dict:
        """The response object as it stands."""
        return {**self.base, "status": self.status, "output": copy.deepcopy(self.output), "usage": self.usage,
                "error": self.error, "incomplete_details": self.incomplete}

    # ---- inputs ---------------------------------------------------------------------------

    def start(self) -> list[dict]:
        out = [self._ev("response.created", response=self.response())]
        self.status = "in_progress"
        out.append(self._ev("response.in_progress", response=self.response()))
        return out

    def text(self, text: str, logprobs: list[dict] | None = None) -> list[dict]:
        if self.logprobs is not None and logprobs:
            self.logprobs.extend(logprobs)
        out: list[dict] = []
        for piece in self.pieces.feed(text):
            self._piece(piece, out)
        return out

    def finish(self, finish_reason: str, *, prompt_tokens: int = 0, completion_tokens: int = 0,
               cached_tokens: int = 0, error: dict | None = None) -> list[dict]:
        """The end: `stop` (completed), `length` (incomplete: max_output_tokens), `cancelled`,
        or `error` (failed, with `error` {code, message})."""
        out: list[dict] = []
        for piece in self.pieces.finish():
            self._piece(piece, out)
        if self.parser is not None:
            content, deltas = self.parser.finish()
            self._apply(content, deltas, out)
        item_status = "incomplete" if finish_reason in ("length", "cancelled", "error") else "completed"
        self._close_msg(out, item_status)
        self._close_call(out, item_status)
        self.usage = usage(prompt_tokens, completion_tokens, cached_tokens)
        self.ended = True
        if finish_reason == "error":
            self.status = "failed"
            error = error or {}
            self.error = {"code": error.get("code", "server_error"), "message": error.get("message", "")}
            out.append(self._ev("response.failed", response=self.response()))
        elif finish_reason == "cancelled":
            self.status = "cancelled"
            out.append(self._ev("response.incomplete", response=self.response()))
        elif finish_reason == "length":
            self.status = "incomplete"
            self.incomplete = {"reason": "max_output_tokens"}
            out.append(self._ev("response.incomplete", response=self.response()))
        else:
            self.status = "completed"
            out.append(self._ev("response.completed", response=self.response()))
        return out

    # ---- internals ------------------------------------------------------------------------

    def _ev(self, kind: str, **fields: Any) -> dict:
        ev = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return ev

    def _piece(self, piece: str, out: list[dict]) -> None:
        if self.parser is None:
            self._content(piece, out)
        else:
            content, deltas = self.parser.feed(piece)
            self._apply(content, deltas, out)

    def _apply(self, content: str, deltas: list[dict], out: list[dict]) -> None:
        # content written before a new call opens comes first; a call's continuation, before content after it
        if deltas and "id" not in deltas[0]:
            self._call_delta(deltas[0], out)
            deltas = deltas[1:]
        self._content(content, out)
        for d in deltas:
            self._call_delta(d, out)

    def _content(self, text: str, out: list[dict]) -> None:
        if not text:
            return
        self._close_call(out, "completed")
        if self._msg is None:
            index = len(self.output)
            item = {"id": f"msg_{self.hex}_{index}", "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            self.output.append(item)
            self._msg = item
            out.append(self._ev("response.output_item.added", output_index=index, item=copy.deepcopy(item)))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            out.append(self._ev("response.content_part.added", item_id=item["id"], output_index=index,
                                content_index=0, part=copy.deepcopy(part)))
        item = self._msg
        item["content"][0]["text"] += text
        out.append(self._ev("response.output_text.delta", item_id=item["id"], output_index=self.output.index(item),
                            content_index=0, delta=text, logprobs=[]))

    def _close_msg(self, out: list[dict], status: str) -> None:
        item, self._msg = self._msg, None
        if item is None:
            return
        index = self.output.index(item)
        part = item["content"][0]
        if self.logprobs is not None:
            part["logprobs"] = self.logprobs
        out.append(self._ev("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=copy.deepcopy(part["logprobs"])))
        out.append(self._ev("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=copy.deepcopy(part)))
        item["status"] = status
        out.append(self._ev("response.output_item.done", output_index=index, item=copy.deepcopy(item)))

    def _call_delta(self, d: dict, out: list[dict]) -> None:
        if "id" in d:       # a new call: its name is known
            self._close_msg(out, "completed")
            self._close_call(out, "completed")
            index = len(self.output)
            item = {"id": f"fc_{self.hex}_{index}", "type": "function_call", "status": "in_progress",
                    "call_id": d["id"], "name": d["function"]["name"], "arguments": ""}
            self.output.append(item)
            self._call = self._calls[d["index"]] = item
            out.append(self._ev("response.output_item.added", output_index=index, item=copy.deepcopy(item)))
        item = self._calls[d["index"]]
        args = d["function"].get("arguments") or ""
        if args:
            item["arguments"] += args
            out.append(self._ev("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=self.output.index(item), delta=args))

    def _close_call(self, out: list[dict], status: str) -> None:
        item, self._call = self._call, None
        if item is None:
            return
        index = self.output.index(item)
        out.append(self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"]))
        item["status"] = status
        out.append(self._ev("response.output_item.done", output_index=index, item=copy.deepcopy(item)))
