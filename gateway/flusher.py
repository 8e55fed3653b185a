"""Chunking policy for one request's output: first token at once, then by time or token count.

Per-token frames cost a syscall, a WebSocket frame and a client wake-up each; at 256 streams
that dominates gateway CPU. Buffering for `interval` (30-60 ms, below what a reader notices) or
`max_tokens` tokens, whichever first, cuts frames by an order of magnitude. The first token
skips the buffer so chunking never adds to time-to-first-token. While a client is slow, tokens
keep merging into the buffer, so a backlog costs memory proportional to text, not to frames.

A sender pass takes along what is nearly due (`due_in_pass`: within a quarter interval), so the
streams of one socket fall into step: each request keeping its own phase (the time of its first
flush) made a socket's 8 streams come due at up to 8 moments, each a pass, a socket write and a
client wake-up. Chunks stay 30-40 ms apart at a 40 ms interval. At 256 streams this cut the
gateway's write syscalls by ~30 % (bench/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Pending:
    text: str
    tokens: int
    seq: int
    logprobs: list | None = None    # the tokens' logprob entries (shared.streams `lp`), when asked
    prompt: list | None = None      # echo / prompt logprobs, with the first token (shared.events `pr`)


class ChunkBuffer:
    def __init__(self, interval_s: float, max_tokens: int):
        self.interval_s = max(0.0, interval_s)
        self.max_tokens = max(1, max_tokens)
        self._parts: list[str] = []
        self._tokens = 0
        self._seq = 0
        self._logprobs: list | None = None
        self._prompt: list | None = None
        self._since: float | None = None    # when the oldest buffered token arrived
        self._last_flush: float | None = None

    def add(self, text: str, tokens: int, seq: int, now: float, logprobs: list | None = None,
            prompt: list | None = None) -> None:
        if prompt is not None:
            self._prompt = prompt
        if text:
            self._parts.append(text)
        if logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(logprobs)
        self._tokens += tokens
        self._seq = max(self._seq, seq)
        if self._since is None:
            self._since = now

    @property
    def empty(self) -> bool:
        return self._since is None

    def due(self, now: float) -> bool:
        """Should the buffer be sent now?"""
        if self._since is None:
            return False
        return now >= self.deadline()

    def due_in_pass(self, now: float) -> bool:
        """Should a sender pass that runs anyway take this buffer along? Due, or due within a
        quarter interval (the module docstring)."""
        return self.due(now + self.interval_s / 4)

    def deadline(self) -> float | None:
        """Monotonic time at which the buffer becomes due (None when empty).

        The clock runs from the previous flush, so a steady stream gets one chunk per interval;
        a token arriving after a pause longer than the interval goes out at once.
        """
        if self._since is None:
            return None
        if self._last_flush is None or self.interval_s == 0.0 or self._tokens >= self.max_tokens:
            return self._since
        return max(self._since, self._last_flush + self.interval_s)

    def look_at(self, now: float) -> float | None:
        """When the sender should look at this buffer next: its deadline while it holds tokens;
        while empty, the end of the interval its last flush started (a token that arrives before
        then is due exactly then, so the sender already sleeping until then need not be woken for
        it: gateway.sender); None when there is nothing to wait for."""
        if self._since is not None:
            return self.deadline()
        if self._last_flush is None or self.interval_s == 0.0:
            return None
        end = self._last_flush + self.interval_s
        return end if end > now else None

    def take(self, now: float) -> Pending | None:
        """Everything buffered as one chunk (also used to drain before `done`)."""
        if self._since is None:
            return None
        out = Pending("".join(self._parts), self._tokens, self._seq, self._logprobs, self._prompt)
        self._logprobs = self._prompt = None
        self._parts.clear()
        self._tokens = 0
        self._since = None
        self._last_flush = now
        return out
