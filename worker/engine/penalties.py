"""Presence, frequency and repetition penalties per row of the runner's batch (vLLM v1's
`PenaltiesState`, kept sparse).

What they do to a row's logits before temperature: OpenAI's definition for presence and
frequency, over the tokens the request has produced so far (`logit -= frequency * count +
presence * (count > 0)`), and the CTRL repetition penalty over the prompt and the output, as
transformers' `RepetitionPenaltyLogitsProcessor` and vLLM apply it (a seen token's logit divided
by the penalty when positive, multiplied when not).

They depend on every token produced so far, so a row keeps its state on the device instead of
recounting its output each step. vLLM keeps dense [rows, vocab] counts; only the tokens of the
context can be penalized, though, and a context is far shorter than the vocabulary, so each row
keeps the distinct ids of its context (`ids`, up to `context` of them, -1 beyond the row's
`n`) with their counts in the output (`counts`; 0: prompt only). A step reads the penalized
rows' logits at those [row, id] places only, penalizes them and writes them back: work and
memory grow with the context (a few hundred entries a row), not with the vocabulary (49k to
150k), and no row is copied. Padding entries of a row are pointed at its first id (every row
has one: a prompt is never empty) with that entry's count, so they compute and write back the
same value and the write stays exact whichever duplicate lands last.

The state is built once when a request takes its row, from its context as it stands (the prompt,
then the output so far: tokens an earlier worker delivered, for a failover continuation, and the
tokens of a preempted request), and then only grows by the step's sampled ids (`record`: a few
[k, width] operations for all penalized rows). So a continuation or a recompute gets exactly the
state an uninterrupted run would have. The tables are allocated at the first penalized request,
and a step in which no row is penalized skips all of it with one integer test (`num_active`).
"""

from __future__ import annotations

import numpy as np
import torch

from shared.sampling import SamplingParams
from worker.engine.host_lists import long_tensor

PRESENCE, FREQUENCY, REPETITION = range(3)   # columns of a row's parameters


class Penalties:
    def __init__(self, rows: int, context: int, device: torch.device):
        """`context`: the most tokens a request's context may hold (the engine's max_seq_len)."""
        self._rows, self._context, self._device = rows, context, device
        self.host = np.zeros((rows, 3), dtype=np.float32)
        self.uses = np.zeros(rows, dtype=bool)
        self.length = np.zeros(rows, dtype=np.int64)   # each row's context length: a bound on its `n`
        self.num_active = 0
        self._dev: torch.Tensor | None = None      # `host` on the device
        self.ids: torch.Tensor | None = None       # [rows, context] distinct context ids, -1 past n
        self.counts: torch.Tensor | None = None    # [rows, context] float32: their counts in the output
        self.n: torch.Tensor | None = None         # [rows] distinct ids of each row

    def add(self, slot: int, p: SamplingParams, tokens: list[int], prompt_len: int) -> None:
        """Row `slot` is taken by a request with context `tokens` (its first `prompt_len` the prompt)."""
        if not p.penalized:
            return
        dev = self._device
        if self.ids is None:
            self.ids = torch.full((self._rows, self._context), -1, dtype=torch.long, device=dev)
            self.counts = torch.zeros(self._rows, self._context, dtype=torch.float32, device=dev)
            self.n = torch.zeros(self._rows, dtype=torch.long, device=dev)
            self._dev = torch.zeros(self._rows, 3, dtype=torch.float32, device=dev)
        context = np.asarray(tokens, dtype=np.int64)
        seen = np.unique(context)
        out, times = np.unique(context[prompt_len:], return_counts=True)
        counts = np.zeros(len(seen), dtype=np.float32)
        counts[np.searchsorted(seen, out)] = times
        n = len(seen)
        self.ids[slot].fill_(-1)
        self.ids[slot, :n] = torch.from_numpy(seen).to(dev)
        self.counts[slot].zero_()
        self.counts[slot, :n] = torch.from_numpy(counts).to(dev)
        self.n[slot] = n
        self.host[slot] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        self._dev[slot] = torch.from_numpy(self.host[slot]).to(dev)
        self.length[slot] = len(tokens)
        self.uses[slot] = True
        self.num_active += 1

    def remove(self, slot: int) -> None:
        if self.uses[slot]:
            self.uses[slot] = False
            self.num_active -= 1

    def _rows_of(self, slots: np.ndarray, device):
        """Of a step's sampled rows (`slots`): the positions of the penalized ones (host, device),
        their slots on the device, and the width their entries need (their longest context)."""
        rows = np.flatnonzero(self.uses[slots])
        width = int(self.length[slots[rows]].max(initial=0))
        return rows, long_tensor(rows, device), long_tensor(slots[rows], device), width

    def apply(self, logits: torch.Tensor, slots: np.ndarray) -> None:
        """Penalize, in place, the rows of `logits` [R, V] (float32, contiguous) whose slots are
        `slots`: read and written at [row, id] only, never a whole row."""
        rows, rows_t, sl, width = self._rows_of(slots, logits.device)
        if not len(rows):
            return
        host = self.host[slots[rows]]
        ids, counts = self.ids[:, :width].index_select(0, sl), self.counts[:, :width].index_select(0, sl)
        pad = torch.arange(width, device=logits.device)[None, :] >= self.n.index_select(0, sl)[:, None]
        ids, counts = torch.where(pad, ids[:, :1], ids), torch.where(pad, counts[:, :1], counts)
        flat = (rows_t[:, None] * logits.shape[1] + ids).view(-1)
        vals = logits.view(-1).index_select(0, flat).view(len(rows), width)
        params = self._dev.index_select(0, sl)
        if (host[:, REPETITION] != 1).any():   # every entry is a seen token
            rep = params[:, REPETITION, None]
            vals = torch.where(vals > 0, vals / rep, vals * rep)
        if host[:, PRESENCE:REPETITION].any():
            vals = vals - params[:, FREQUENCY, None] * counts - params[:, PRESENCE, None] * (counts > 0)
        logits.view(-1).index_copy_(0, flat, vals.view(-1))

    def record(self, slots: np.ndarray, tokens: torch.Tensor) -> None:
        """The step's sampled `tokens` (one per row of `slots`) join their penalized rows' counts:
        a token already among a row's ids counts once more, a new one is appended at `n`."""
        rows, rows_t, sl, width = self._rows_of(slots, tokens.device)
        if not len(rows):
            return
        tok = tokens if len(rows) == len(slots) else tokens.index_select(0, rows_t)
        match = self.ids[:, :width].index_select(0, sl) == tok[:, None]
        hit = match.any(dim=1)
        n = self.n.index_select(0, sl)
        at = torch.where(hit, match.int().argmax(dim=1), n)
        self.ids.index_put_((sl, at), tok)
        self.counts.index_put_((sl, at), torch.ones(len(rows), device=tokens.device), accumulate=True)
        self.n.index_copy_(0, sl, n + (~hit).long())
        self.length[slots[rows]] += 1
