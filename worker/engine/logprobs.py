"""Per-token log-probabilities for the requests that ask (OpenAI's `logprobs` / `top_logprobs`).

What they are: the log-softmax of the model's raw logits of the step that sampled the token,
before temperature, top-k / top-p and EOS masking (`ignore_eos`): vLLM v1's default
(`logprobs_mode="raw_logprobs"`: "use the original logits, before any penalties or temperature
scaling"), so a request's logprobs say what the model thinks, whatever it was sampled with.
Each token gets its own logprob (always, also when it is not among the top ones) and its row's
`k` most likely tokens, most likely first.

Cost only where asked. The runner's batch counts its rows that ask (`InputBatch.num_logprobs`);
while none does, a step does nothing here (one integer test). Otherwise the step gathers the
sampled rows' `top_logprobs` (-1: none) from the batch in one numpy index and, on the device,
for the asking rows only (all of the step's logits when every row asks, else one
`index_select`): a float32 logsumexp per row and the top-k of the raw logits (the same order as
the logprobs), before the EOS mask is applied; after sampling, each asking row's sampled logit
(never a masked one: a masked token is never sampled). No [rows, vocab] log-softmax is written:
logprob = logit - logsumexp, on k + 1 numbers a row (on a CPU at 64 rows of a 49k vocabulary,
half the time of log_softmax + topk). The sampled tokens of the whole step and those numbers
come back in ONE host transfer (token ids ride as float32, exact below 2**24).

Tokens as text (`TokenText`): each id decoded alone with special tokens kept, as vLLM does
(`tokenizer.decode([id])`), memoised per id; a token that is part of a multi-byte character
decodes to U+FFFD. `text_offset` of a token is the sum of the lengths of the output tokens'
strings before it (vLLM's rule for the completions API), counted over the whole output, tokens
of an earlier run included (failover continuation), so a resumed stream gets the same offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.engine.host_lists import long_tensor

FLOOR = -9999.0           # a logprob of -inf is sent as this (JSON has no -inf; vLLM does the same)


@dataclass
class _Pending:
    rows: np.ndarray          # indices (in the step's sampled rows) of the rows that ask
    ks: np.ndarray            # their top_logprobs
    idx: torch.Tensor         # rows on the device
    logits: torch.Tensor      # the step's logits (the sampled token's logit is read after sampling)
    lse: torch.Tensor         # [asking rows] float32 logsumexp of their raw logits
    top: tuple | None         # (values, ids) [asking rows, kmax] of their raw logits; None: kmax 0
    kmax: int


class LogprobGather:
    """The runner's part: the asking rows' logprobs from a step's logits, and the one transfer
    that brings them (with the sampled tokens) to the host."""

    @staticmethod
    def prepare(logits: torch.Tensor, ks: np.ndarray) -> _Pending | None:
        """Before sampling (and before the logits are masked): the log-softmax of the rows that
        ask (`ks`: each sampled row's top_logprobs, -1 for none); None when no row asks."""
        rows = np.flatnonzero(ks >= 0)
        if not len(rows):
            return None
        idx = long_tensor(rows, logits.device)
        mine = logits if len(rows) == len(ks) else logits.index_select(0, idx)
        kmax = int(ks[rows].max())
        return _Pending(rows, ks[rows], idx, logits, mine.float().logsumexp(dim=-1),
                        mine.topk(kmax, dim=-1) if kmax else None, kmax)

    @staticmethod
    def finish(pending: _Pending, tokens: torch.Tensor) -> tuple[list[int], list]:
        """After sampling: (every row's token id, per row its (logprob, top ids, top logprobs)
        or None), from one host transfer."""
        n, r, k = tokens.shape[0], len(pending.rows), pending.kmax
        chosen = pending.logits[pending.idx, tokens.index_select(0, pending.idx)].float() - pending.lse
        parts = [tokens.float(), chosen]
        if k:
            vals, ids = pending.top
            parts += [(vals.float() - pending.lse[:, None]).flatten(), ids.float().flatten()]
        flat = torch.cat(parts).tolist()
        ids_out = [int(t) for t in flat[:n]]
        per_row: list = [None] * n
        base = n + r
        for j, (row, kj) in enumerate(zip(pending.rows.tolist(), pending.ks.tolist())):
            top_lps = flat[base + j * k : base + j * k + kj]
            top_ids = [int(t) for t in flat[base + r * k + j * k : base + r * k + j * k + kj]]
            per_row[row] = (flat[n + j], top_ids, top_lps)
        return ids_out, per_row


def prompt_echo(seq, words: "TokenText", tokenizer) -> list:
    """What a request's first emitted token carries for echo / prompt logprobs (StepOutput.prompt):
    the prompt as text, and per prompt token [token, logprob, top, text_offset] (the first
    token's logprob None: nothing precedes it), offsets counted over the prompt's tokens. Both
    are sent once: the request asks for nothing more afterwards."""
    text = entries = None
    ids = seq.req.prompt_ids
    if seq.echo:
        text = seq.req.prompt_text if seq.req.prompt_text is not None else \
            tokenizer.decode(ids, skip_special_tokens=False)
    if seq.prompt_lp_k >= 0:
        entries, offset = [[words(ids[0]), None, [], 0]], len(words(ids[0]))
        for token, row in zip(ids[1:], seq.prompt_rows):
            entries.append(entry(words, token, row, offset))
            offset += len(words(token))
    seq.echo, seq.prompt_lp_k, seq.prompt_rows = False, -1, []
    return [text, entries]


def prompt_rows(logits: torch.Tensor, targets: list[int], k: int) -> list[tuple[float, list[int], list[float]]]:
    """Prompt logprobs (vLLM's `prompt_logprobs`): per row of `logits` (the prompt positions a
    prefill chunk computed for the requests that ask), the raw logprob of the next prompt token
    `targets[i]` and the `k` most likely tokens, as `LogprobGather.finish` gives them, from one
    host transfer. The chunk's other positions get no logits at all."""
    lse = logits.float().logsumexp(dim=-1)
    chosen = logits.gather(1, long_tensor(targets, logits.device)[:, None])[:, 0].float() - lse
    parts = [chosen]
    if k:
        vals, ids = logits.topk(k, dim=-1)
        parts += [(vals.float() - lse[:, None]).flatten(), ids.float().flatten()]
    flat = torch.cat(parts).tolist()
    r = len(targets)
    return [(flat[i], [int(t) for t in flat[r + r * k + i * k : r + r * k + (i + 1) * k]],
             flat[r + i * k : r + (i + 1) * k]) for i in range(r)]


class TokenText:
    """Token id -> its string alone (memoised: the vocabulary bounds it)."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode = (lambda ids: backend.decode(ids, skip_special_tokens=False)) if backend is not None else \
            (lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
        self._memo: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._memo.get(token_id)
        if text is None:
            text = self._memo[token_id] = self._decode([token_id])
        return text

    def length(self, token_ids) -> int:
        """The text offset after these tokens (continuation: the tokens an earlier run delivered)."""
        return sum(len(self(t)) for t in token_ids)


def entry(text: TokenText, token_id: int, row: tuple, offset: int) -> list:
    """One token's logprobs as the worker sends them: [token, logprob, [[token, logprob], ...],
    text_offset] (shared.streams, `lp` of a token event)."""
    logprob, top_ids, top_lps = row
    return [text(token_id), max(logprob, FLOOR), [[text(t), max(lp, FLOOR)] for t, lp in zip(top_ids, top_lps)],
            offset]
