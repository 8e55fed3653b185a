"""Presence, frequency and repetition penalties per row of the runner's batch (vLLM v1's
`PenaltiesState`).

What they do to a row's logits before temperature: OpenAI's definition for presence and
frequency, over the tokens the request has produced so far (`logit -= frequency * count +
presence * (count > 0)`), and the CTRL repetition penalty over the prompt and the output, as
transformers' `RepetitionPenaltyLogitsProcessor` and vLLM apply it (a seen token's logit divided
by the penalty when positive, multiplied when not).

They depend on every token produced so far, so a row keeps its counts on the device instead of
recounting its output each step: `counts` [rows, vocab] (output tokens, float32, the form the
math uses) and `seen` [rows, vocab] (prompt or output). Both are built once when a request
takes its row, from its context as it stands (the prompt, then the output so far: tokens an
earlier worker delivered, for a failover continuation, and the tokens of a preempted request),
and then only grow by the step's sampled ids (`record`: one `index_put_` for all penalized
rows). So a continuation or a recompute gets exactly the state an uninterrupted run would have.

The [rows, vocab] tables are allocated at the first penalized request (a deployment that never
sees one pays no memory), and a step in which no row is penalized skips all of it with one
integer test (`num_active`).
"""

from __future__ import annotations

import numpy as np
import torch

from shared.sampling import SamplingParams
from worker.engine.host_lists import long_tensor

PRESENCE, FREQUENCY, REPETITION = range(3)   # columns of a row's parameters


class Penalties:
    def __init__(self, rows: int, vocab: int, device: torch.device):
        self._rows, self._vocab, self._device = rows, vocab, device
        self.host = np.zeros((rows, 3), dtype=np.float32)
        self.uses = np.zeros(rows, dtype=bool)
        self.num_active = 0
        self._dev: torch.Tensor | None = None     # `host` on the device
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None

    def add(self, slot: int, p: SamplingParams, tokens: list[int], prompt_len: int) -> None:
        """Row `slot` is taken by a request with context `tokens` (its first `prompt_len` the prompt)."""
        if not p.penalized:
            return
        if self.counts is None:
            self.counts = torch.zeros(self._rows, self._vocab, dtype=torch.float32, device=self._device)
            self.seen = torch.zeros(self._rows, self._vocab, dtype=torch.bool, device=self._device)
            self._dev = torch.zeros(self._rows, 3, dtype=torch.float32, device=self._device)
        self.host[slot] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        self._dev[slot] = torch.from_numpy(self.host[slot]).to(self._device)
        counts, seen = self.counts[slot], self.seen[slot]
        counts.zero_()
        seen.zero_()
        seen[long_tensor(tokens, self._device)] = True
        if len(tokens) > prompt_len:
            out = long_tensor(tokens[prompt_len:], self._device)
            counts.index_put_((out,), torch.ones(out.shape[0], device=self._device), accumulate=True)
        self.uses[slot] = True
        self.num_active += 1

    def remove(self, slot: int) -> None:
        if self.uses[slot]:
            self.uses[slot] = False
            self.num_active -= 1

    def _rows_of(self, slots: np.ndarray, device) -> tuple[np.ndarray, torch.Tensor | None, torch.Tensor]:
        """Of a step's sampled rows (`slots`): the positions of the penalized ones, those positions
        on the device (None: every row), and their slots on the device."""
        rows = np.flatnonzero(self.uses[slots])
        every = len(rows) == len(slots)
        return rows, None if every else long_tensor(rows, device), long_tensor(slots[rows], device)

    def apply(self, logits: torch.Tensor, slots: np.ndarray) -> None:
        """Penalize, in place, the rows of `logits` [R, V] (float32) whose slots are `slots`."""
        rows, idx, sl = self._rows_of(slots, logits.device)
        if not len(rows):
            return
        host = self.host[slots[rows]]
        part = logits if idx is None else logits.index_select(0, idx)
        params = self._dev.index_select(0, sl)
        if (host[:, REPETITION] != 1).any():
            rep = params[:, REPETITION, None]
            part = torch.where(self.seen.index_select(0, sl), torch.where(part > 0, part / rep, part * rep), part)
        if host[:, PRESENCE:REPETITION].any():
            counts = self.counts.index_select(0, sl)
            part = part - params[:, FREQUENCY, None] * counts - params[:, PRESENCE, None] * (counts > 0)
        if idx is None:
            logits.copy_(part)
        else:
            logits.index_copy_(0, idx, part)

    def record(self, slots: np.ndarray, tokens: torch.Tensor) -> None:
        """The step's sampled `tokens` (one per row of `slots`) join their penalized rows' counts."""
        rows, idx, sl = self._rows_of(slots, tokens.device)
        if not len(rows):
            return
        tok = tokens if idx is None else tokens.index_select(0, idx)
        self.counts.index_put_((sl, tok), torch.ones(len(rows), device=tokens.device), accumulate=True)
        self.seen.index_put_((sl, tok), torch.ones(len(rows), dtype=torch.bool, device=tokens.device))
