"""Tool calls read out of a streamed answer, as OpenAI's `tool_calls` (message and deltas).

Two shapes of answer (shared.structured.tool_mode):
* `forced` (`tool_choice: "required"` or a named function): the engine's grammar made the whole
  answer one object `{"name": ..., "arguments": {...}}`;
* `auto`: free text in which the model may call tools in the Hermes format that Qwen2/2.5's
  chat templates (and the fallback prompt for templates without tools, worker.engine.prompts)
  teach: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; the text around the
  calls is the message's content.

The parser is incremental, so a stream carries OpenAI's deltas: a call's first delta has its
`id`, `type` and function `name` (as soon as the name is complete), then fragments of
`arguments` as they arrive. What could still turn out to be the end of a call (closing braces,
blanks, a partial `</tool_call>` tag) is held back until the next text decides, so every
fragment sent is a piece of the final arguments. Text that starts like a tag but is not a
well-formed call is given back as content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Callable

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_TAIL = " \t\r\n}"


def _held_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class _Call:
    index: int
    name: str
    start: int                 # where its arguments begin in the parser's buffer
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))
    sent: int = 0              # characters of its arguments already sent
    arguments: str = ""


class ToolCallParser:
    """Feed the answer's text pieces; get (content, [tool call deltas]) to send for each."""

    def __init__(self, mode: str, call_id: Callable[[int], str] | None = None):
        self.mode = mode
        self.call_id = call_id              # the id of call i (default: random; the Responses API derives them)
        self.buf = ""
        self.calls: list[_Call] = []
        self.content: list[str] = []
        self._pos = 0                       # auto: where the unread text starts
        self._open: int | None = None       # auto: where the open call's JSON starts (after OPEN)
        self._call: _Call | None = None     # the call whose arguments are being read

    # ---- public ------------------------------------------------------------------------

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        return self._advance(final=True)

    def closed_calls(self) -> list[_Call]:
        """The calls whose arguments are complete (`arguments` set): all but the one being read."""
        return [c for c in self.calls if c is not self._call]

    def tool_calls(self) -> list[dict]:
        """The calls, in OpenAI's message shape."""
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls]

    # ---- internals ---------------------------------------------------------------------

    def _advance(self, final: bool) -> tuple[str, list[dict]]:
        deltas: dict[int, dict] = {}
        if self.mode == "forced":
            self._read_call(0, len(self.buf), final, deltas)
            content = ""
            if final and not self.calls:    # cut before a call took shape: the text as it is
                content = self.buf
        else:
            content = self._auto(final, deltas)
        if content:
            self.content.append(content)
        return content, [deltas[i] for i in sorted(deltas)]

    def _read_call(self, start: int, end: int, final: bool, deltas: dict[int, dict]) -> bool:
        """Read the call JSON in buf[start:end]; False if it has no name yet (or, final, never will)."""
        call = self._call
        if call is None:
            m = _HEAD.match(self.buf, start, end)
            if m is None:
                return False
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                return False
            call = self._call = _Call(len(self.calls), name, m.end())
            if self.call_id is not None:
                call.id = self.call_id(call.index)
            self.calls.append(call)
            deltas[call.index] = {"index": call.index, "id": call.id, "type": "function",
                                  "function": {"name": name, "arguments": ""}}
        raw = self.buf[call.start:end]
        if final:
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
            call.arguments = raw
            safe = raw
        else:
            safe = raw.rstrip(_TAIL)
        if len(safe) > call.sent:
            d = deltas.setdefault(call.index, {"index": call.index, "function": {"arguments": ""}})
            d["function"]["arguments"] += safe[call.sent:]
            call.sent = len(safe)
        if final:
            self._call = None
        return True

    def _auto(self, final: bool, deltas: dict[int, dict]) -> str:
        out = []
        while True:
            if self._open is None:
                i = self.buf.find(OPEN, self._pos)
                if i < 0:
                    end = len(self.buf) if final else len(self.buf) - _held_tag(self.buf[self._pos:], OPEN)
                    out.append(self.buf[self._pos:end])
                    self._pos = end
                    break
                text = self.buf[self._pos:i]
                out.append(text if text.strip() else "")    # blanks before a call are no content
                self._open = self._pos = i + len(OPEN)
                continue
            j = self.buf.find(CLOSE, self._open)
            end = j if j >= 0 else len(self.buf)
            if j < 0 and not final:
                self._read_call(self._open, end - _held_tag(self.buf[self._open:end], CLOSE), False, deltas)
                break
            if not self._read_call(self._open, end, True, deltas):   # not a call: its text is content
                out.append(OPEN + self.buf[self._open:end + (len(CLOSE) if j >= 0 else 0)])
            self._pos = end + len(CLOSE) if j >= 0 else end
            self._open = None
            if j < 0:
                break
        text = "".join(out)
        if self.calls and not text.strip():
            return ""
        return text
