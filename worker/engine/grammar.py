"""Grammar-constrained decoding (structured output: `response_format` JSON, forced tool calls).

A request whose `SamplingParams.grammar` is set gets a matcher (xgrammar's `GrammarMatcher`)
when it joins the engine. Before each of its sampled tokens the matcher fills the row's token
bitmask on the host (one bit per vocabulary token: may it come next?), the masks of the step's
constrained rows go to the device in one copy, and the disallowed logits of those rows only are
set to -inf before sampling (`apply_masks`). The runner's batch counts its rows that are
constrained (`InputBatch.num_constrained`); while none is, a step does nothing here (one integer
test). The matcher advances with each sampled token (`accept`); when the grammar is complete the
request finishes with `stop`, without waiting for an EOS token.

The matcher's state is a function of the generated tokens alone, so it needs nothing to survive
chunked prefill (it only moves on sampled tokens) or a preemption (the tokens it has seen are
still the request's tokens; recomputing their KV changes nothing here). A failover continuation
replays the already delivered tokens into a fresh matcher (`Engine.add`).

Why xgrammar rather than llguidance: bench/grammar_libs.py on SmolLM2's 49k vocabulary, the
per-token mask fill is 1-3 us against llguidance's 9-10 us (medians; bench/RESULTS.md), and the
fill is what every constrained row pays every step; compiling a schema (once per request,
cached by xgrammar per schema) is ~5 ms against ~1 ms.

Compiling runs off the engine thread, within limits (worker.engine.grammar_compile): a request
with a grammar joins the batch once its matcher is ready.

Specs (`grammar` dicts, JSON-serializable so they cross Redis): `{"type": "json_object"}` (any
JSON object) and `{"type": "json_schema", "schema": {...}}`, with `"param": "tools"` where the
schema is a forced tool call's (refusals then name `tools`). JSON is produced with fixed
separators (", ", ": ") and no free whitespace: a model cannot stall in endless blanks.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from worker.engine.grammar_compile import Compile, CompilePool, GrammarError, GrammarLimits, GrammarRefused
from worker.engine.host_lists import long_tensor

__all__ = ["Compile", "GrammarError", "GrammarLimits", "GrammarRefused", "Grammars", "Matcher"]


class Matcher:
    """One request's position in its grammar."""

    __slots__ = ("_m",)

    def __init__(self, matcher) -> None:
        self._m = matcher

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        return bool(self._m.accept_token(token))

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing may follow (the request stops here)."""
        return bool(self._m.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)


class Grammars:
    """Compiles specs for one engine's tokenizer (on `compile_pool`'s threads) and applies the masks of a
    step's constrained rows. The tokenizer's token table (~0.1-0.4 s to build) is made by the
    first compile, in a compile thread."""

    def __init__(self, tokenizer, vocab: int, eos_ids: Callable[[], set[int]], max_rows: int, device: torch.device,
                 limits: GrammarLimits | None = None):
        self._tokenizer = tokenizer
        self._vocab = vocab            # the logits' width (may exceed the tokenizer's vocabulary)
        self._eos_ids = eos_ids
        self._device = device
        # bitmask words: every token but those with control bytes (set by the first compile,
        # before any matcher exists)
        self._clean: torch.Tensor | None = None
        words = (vocab + 31) // 32
        self._host = torch.zeros(max_rows, words, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        self.compile_pool = CompilePool(self._build, _new_matcher, limits or GrammarLimits())

    def _build(self, threads: int, cache_bytes: int):
        """The xgrammar compiler for this tokenizer (in a compile thread, once)."""
        import xgrammar as xgr
        info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab,
                                                  stop_token_ids=sorted(self._eos_ids()) or None)
        compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True, cache_limit_bytes=cache_bytes)
        if self._clean is None:
            # JSON strings may not hold raw control characters, which xgrammar's string rule
            # lets through (a random model wrote \x01 into one); the JSON written here needs
            # none (fixed separators, no free whitespace), so tokens with one are never allowed
            words = self._host.shape[1]
            clean = np.full(words * 32, True)
            clean[[i for i, b in enumerate(info.decoded_vocab) if any(c < 0x20 for c in b)]] = False
            self._clean = torch.from_numpy(np.packbits(clean, bitorder="little").view(np.int32).copy())
        return compiler

    def compile(self, spec: dict) -> Compile:
        """Start compiling `spec` for a request (worker.engine.grammar_compile); never blocks."""
        return self.compile_pool.submit(spec)

    def matcher(self, spec: dict) -> Matcher:
        """A fresh matcher for `spec` compiled in the calling thread (tests, benchmarks), or GrammarRefused."""
        return self.compile_pool.compile_now(spec)

    def _allowed(self, host: torch.Tensor, vocab: int) -> torch.Tensor:
        """Bitmask rows [k, words] (bit j of word w: token 32w + j) -> bool [k, vocab] on the
        device. A GPU unpacks the uploaded words itself (a few KB a row cross the bus); a CPU
        unpacks with numpy's unpackbits, ~25x faster than the same shifts in torch there."""
        k = host.shape[0]
        if self._device.type == "cpu":
            bits = np.unpackbits(host.numpy().view(np.uint8), axis=1, bitorder="little")
            return torch.from_numpy(bits[:, :vocab]).view(torch.bool)
        masks = host.to(self._device, non_blocking=True)
        return ((masks.unsqueeze(-1) >> self._shifts) & 1).view(k, -1)[:, :vocab].bool()

    def apply_masks(self, logits: torch.Tensor, rows: np.ndarray, matchers: list[Matcher]) -> None:
        """Set the logits of tokens each constrained row's grammar forbids to -inf: `rows` are
        the constrained rows of `logits` [R, V] (ascending), `matchers` their matchers."""
        k = len(rows)
        host = self._host[:k]
        host.fill_(0)
        for j, matcher in enumerate(matchers):
            matcher.fill(host, j)
        host &= self._clean
        allowed = self._allowed(host, logits.shape[-1])
        if k == logits.shape[0]:
            logits.masked_fill_(~allowed, float("-inf"))
            return
        idx = long_tensor(np.asarray(rows), logits.device)
        part = logits.index_select(0, idx).masked_fill_(~allowed, float("-inf"))
        logits.index_copy_(0, idx, part)



def _new_matcher(compiled) -> Matcher:
    import xgrammar as xgr
    return Matcher(xgr.GrammarMatcher(compiled, terminate_without_stop_token=True))
