"""Logit bias and min_tokens per row of the runner's batch (vLLM v1's `LogitBiasState`).

* `logit_bias` (OpenAI's): a number added to the logits of the listed token ids before sampling
  (+100 all but forces a token, -100 all but forbids it). A row's ids and values sit in a padded
  table row (`ids`, `vals`; padding: id 0, value 0.0, which adds nothing), written when the
  request takes its row; a step adds them with one `index_add_` at the biased rows' [row, id]
  places, as many a row as the longest of their lists.
* `min_tokens` (vLLM's): until a request has produced that many tokens, nothing may end it: its
  end ids (the model's EOS ids and its own `stop_token_ids`) get -inf. A row's countdown
  (`min_left`) starts from the output it already has (a continuation's delivered tokens, a
  preempted request's) and goes down by one for every sampled row in one numpy operation.

Both tables are allocated at the first request that needs them, and a step in which no row uses
either pays one integer test each (`num_biased`, `num_min`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from shared.sampling import MAX_LOGIT_BIAS, SamplingParams
from worker.engine.host_lists import long_tensor


class LogitBias:
    def __init__(self, rows: int, device: torch.device, end_ids: Callable[[], set[int]]):
        self._rows, self._device, self._end_ids = rows, device, end_ids
        self.width = np.zeros(rows, dtype=np.int64)       # bias entries of each row (0: none)
        self.num_biased = 0
        self.ids: torch.Tensor | None = None              # [rows, MAX_LOGIT_BIAS] on the device
        self.vals: torch.Tensor | None = None
        self.min_left = np.zeros(rows, dtype=np.int64)    # tokens still to produce before an end
        self.num_min = 0
        self.ends = np.zeros((rows, 0), dtype=np.int64)   # each row's end ids, padded with its first
        self.num_ends = np.zeros(rows, dtype=np.int64)

    def add(self, slot: int, p: SamplingParams, produced: int) -> None:
        """Row `slot` is taken by a request that has produced `produced` tokens so far."""
        if p.logit_bias:
            if self.ids is None:
                self.ids = torch.zeros(self._rows, MAX_LOGIT_BIAS, dtype=torch.long, device=self._device)
                self.vals = torch.zeros(self._rows, MAX_LOGIT_BIAS, dtype=torch.float32, device=self._device)
            n = len(p.logit_bias)
            self.ids[slot, :n] = torch.tensor(list(p.logit_bias), dtype=torch.long)
            self.vals[slot, :n] = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
            self.width[slot] = n
            self.num_biased += 1
        left = p.min_tokens - produced
        ends = sorted(set(self._end_ids()) | set(p.stop_token_ids))
        if left > 0 and ends:
            if len(ends) > self.ends.shape[1]:   # wider: each row repeats its last entry (its own end id)
                more = len(ends) - self.ends.shape[1]
                self.ends = np.pad(self.ends, ((0, 0), (0, more)), mode="edge" if self.ends.shape[1] else "constant")
            self.ends[slot] = ends[0]
            self.ends[slot, :len(ends)] = ends
            self.num_ends[slot] = len(ends)
            self.min_left[slot] = left
            self.num_min += 1

    def remove(self, slot: int) -> None:
        if self.width[slot]:
            self.ids[slot].zero_()
            self.vals[slot].zero_()
            self.width[slot] = 0
            self.num_biased -= 1
        if self.min_left[slot] > 0:
            self.min_left[slot] = 0
            self.num_min -= 1

    def apply(self, logits: torch.Tensor, slots: np.ndarray) -> None:
        """Bias, then forbid the end ids of rows still short of their min_tokens, in place, on the
        rows of `logits` [R, V] (float32) whose slots are `slots`."""
        if self.num_biased:
            rows = np.flatnonzero(self.width[slots])
            if len(rows):
                sl = long_tensor(slots[rows], logits.device)
                w = int(self.width[slots[rows]].max())
                ids, vals = self.ids[:, :w].index_select(0, sl), self.vals[:, :w].index_select(0, sl)
                flat = long_tensor(rows, logits.device)[:, None] * logits.shape[1] + ids
                logits.view(-1).index_add_(0, flat.view(-1), vals.reshape(-1))
        if self.num_min:
            rows = np.flatnonzero(self.min_left[slots] > 0)
            if len(rows):
                sl = slots[rows]
                ends = self.ends[sl, :int(self.num_ends[sl].max())]
                logits[long_tensor(np.repeat(rows, ends.shape[1]), logits.device),
                       long_tensor(ends.ravel(), logits.device)] = float("-inf")

    def advance(self, slots: np.ndarray) -> None:
        """Each row of `slots` produced one token."""
        if self.num_min:
            left = self.min_left[slots]
            self.num_min -= int((left == 1).sum())
            self.min_left[slots] = np.maximum(left - 1, 0)
