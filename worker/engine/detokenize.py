"""Incremental detokenization with stop strings.

Text is decoded with a sliding window over the token ids, as vLLM and TGI do (prefix_offset /
read_offset): decoding a few tokens of context before the new ones keeps spacing right for
tokenizers that merge across tokens, and text ending in U+FFFD (an incomplete UTF-8 sequence
spread over several byte tokens) is held back until the next token completes it. Stop strings
are matched on the decoded text; a tail that could still become a stop string is held back too,
so a stop string is never partly emitted. vLLM's controls: `skip_special_tokens` (False: their
text is shown), `include_stop` (the stop string stays in the text) and `min_tokens` (no stop
string is looked for in the text of the first that many tokens; one may end in the next).

Where the tokenizers library has it, each token is decoded by its Rust `DecodeStream`, which
runs the same window (same offsets, same hold-back rule) in one call per token instead of two
decodes and the list slicing around them: at GPU speed this is per row per step, and it was a
third of the engine's host time per row. Our own offsets are kept in step with it, so `finish()`
and a fallback (a tokenizer it refuses) continue from the same state.
"""

from __future__ import annotations

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], *, skip_special_tokens: bool = True,
                 include_stop: bool = False, min_tokens: int = 0):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._added = 0
        # A fast tokenizer's Rust backend decodes exactly what transformers' `decode` returns
        # with `clean_up_tokenization_spaces=False`, without ~8 us of Python around each call
        # (two calls per token per request: at a few hundred rows per step that was most of
        # the engine's host time).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode = getattr(backend, "decode", None)
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._backend = backend
        self._stream = None
        if self._backend_decode is not None and DecodeStream is not None:
            try:  # primed with the same context window as ours (needs tokenizers >= 0.22)
                self._stream = DecodeStream(ids=list(self._ids), skip_special_tokens=skip_special_tokens)
            except TypeError:  # no `ids` priming in this version: our window does it all
                pass
        self._stop = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stop), default=0)
        # decoded text not yet released, after the released text's last max_stop - 1 characters
        # (where a stop string may begin); older text is dropped, so a token costs the same at
        # any output length (keeping all of it made each token copy the whole output)
        self.text = ""
        self.emitted = 0      # characters of `text` already released
        self.stopped = False  # a stop string was found

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self._skip)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the newly releasable text (maybe "")."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        self._added += 1
        new = None
        if self._stream is not None:
            try:
                new = self._stream.step(self._backend, token_id)
            except Exception:  # e.g. a decode that does not extend the last one: use ours from here
                self._stream = None
            else:
                if not self._stop:
                    # The common case, once per row per step: without stop strings nothing is
                    # held back, so the stream's text goes out as it comes (`text` stays empty,
                    # as `_release` would leave it).
                    if new is not None:
                        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                    return new or ""
        if self._stream is None:
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
                new = full[len(prefix):]
        if new is not None:
            start = len(self.text)
            self.text += new
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            if self._stop and self._added > self._min_tokens:
                self._find_stop(max(0, start - self._max_stop + 1))
        return self._release(final=False)

    def finish(self) -> str:
        """Release everything left (held-back partial stop match or trailing incomplete bytes)."""
        if not self.stopped and self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            self.text += full[len(prefix):]
            self._read_offset = len(self._ids)
        return self._release(final=True)

    def _find_stop(self, search_from: int) -> None:
        hits = [(i, i + len(s)) for i, s in ((self.text.find(s, search_from), s) for s in self._stop) if i >= 0]
        if hits:
            start, end = min(hits)
            self.text = self.text[: end if self._include_stop else start]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final and not self.stopped and self._stop:
            end -= self._partial_stop_len()
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        cut = end - max(0, self._max_stop - 1)
        if cut > 0:
            self.text, self.emitted = self.text[cut:], self.emitted - cut
        return out

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        tail = self.text[-self._max_stop :] if self._max_stop else ""
        for n in range(min(len(tail), self._max_stop - 1), 0, -1):
            suffix = tail[-n:]
            if any(s.startswith(suffix) for s in self._stop):
                return n
        return 0
