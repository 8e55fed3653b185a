"""The runner's per-row state of the running requests (vLLM v1's `InputBatch`).

Each running request owns one row (`Sequence.slot`) from the step that admits it to the step
that preempts it or the moment it ends, and everything the runner reads per row per step lives
here, keyed by row, so a step gathers it by the sampled rows' indices (numpy on the host,
`index_select` on the device) instead of walking requests:

* sampling parameters (`sampling.SamplingTable`: temperature, top-k, top-p, min-p, EOS mask,
  seed and generator), written once, when the row is taken;
* penalties with the counts of the tokens produced so far (`penalties.Penalties`), logit bias and
  the min_tokens countdown (`logit_bias.LogitBias`), built from the request's context when the
  row is taken and advanced with each step's sampled ids;
* the structured-output matcher of a constrained request (grammar.py; the request keeps it
  across preemption, the row only points at it);
* how many top logprobs the request wants (-1: none);
* for the paged kernel, the row of the block tables and how many of the request's blocks it
  holds already (blocks are only ever appended while running, so a step writes the new ones).

The counts of rows that ask for something (`num_constrained`, `num_logprobs`, and the
penalties' and bias's own) change only as rows are taken and given back (and min_tokens' as rows
reach it), so a step in which no row asks skips that work with one integer test. Rows follow the scheduler's plan at the start of each step (`update`: `admitted` take one,
`preempted` give theirs back) and the engine gives back the row of a request that ends
(`remove`); the scheduler never hands rows out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from worker.engine.logit_bias import LogitBias
from worker.engine.penalties import Penalties
from worker.engine.sampling import SamplingTable

if TYPE_CHECKING:
    from worker.engine.scheduler import StepPlan
    from worker.engine.sequence import Sequence


class InputBatch:
    def __init__(self, rows: int, device: torch.device, *, table_width: int = 0, scratch_block: int = 0,
                 context: int = 0, end_ids=set):
        """`rows` requests at most; `table_width` > 0: block tables of that many blocks a row
        (the paged kernel's), plus one padding row (`pad_row`) that holds `scratch_block`;
        `context`: the most tokens of one request's context; `end_ids()`: the model's EOS ids
        (what min_tokens holds off)."""
        self.sampling = SamplingTable(rows, device)
        self.penalties = Penalties(rows, context, device)
        self.bias = LogitBias(rows, device, end_ids)
        self._matchers: list = [None] * rows
        self._constrained = np.zeros(rows, dtype=bool)
        self.top_logprobs = np.full(rows, -1, dtype=np.int64)
        self.num_constrained = 0      # rows whose request has a grammar
        self.num_logprobs = 0         # rows whose request asks for logprobs
        self._free = list(range(rows - 1, -1, -1))   # popped lowest first
        self._staged = [0] * rows     # blocks of each row's request its block table row holds
        self.pad_row = rows
        self.host_tables = self.block_tables = None
        self._tables_dirty = False
        if table_width:
            pin = device.type == "cuda"
            self.host_tables = torch.zeros(rows + 1, table_width, dtype=torch.int32, pin_memory=pin)
            self._host_tables_np = self.host_tables.numpy()
            self._host_tables_np[self.pad_row, 0] = scratch_block
            self.block_tables = self.host_tables if device.type == "cpu" else self.host_tables.to(device)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def update(self, plan: StepPlan) -> None:
        """Rows for the requests the plan admitted, then back from those it preempted (one
        admitted and preempted in the same step takes a row and gives it back)."""
        for seq in plan.admitted:
            self.add(seq)
        for seq in plan.preempted:
            self.remove(seq)

    def add(self, seq: Sequence) -> None:
        slot = self._free.pop()
        seq.slot = slot
        p = seq.req.params
        self.sampling.write(slot, p.temperature, p.top_k, p.top_p, seq.ignore_eos, seq.generator, p.min_p)
        self.penalties.add(slot, p, seq.tokens, seq.prompt_len)
        self.bias.add(slot, p, len(seq.tokens) - seq.prompt_len)
        self._staged[slot] = 0
        if seq.grammar is not None:
            self._matchers[slot] = seq.grammar
            self._constrained[slot] = True
            self.num_constrained += 1
        if seq.top_logprobs >= 0:
            self.top_logprobs[slot] = seq.top_logprobs
            self.num_logprobs += 1

    def remove(self, seq: Sequence) -> None:
        """Give `seq`'s row back (nothing if it holds none)."""
        slot = seq.slot
        if slot < 0:
            return
        seq.slot = -1
        self.sampling.clear(slot)
        self.penalties.remove(slot)
        self.bias.remove(slot)
        if self._constrained[slot]:
            self._matchers[slot] = None
            self._constrained[slot] = False
            self.num_constrained -= 1
        if self.top_logprobs[slot] >= 0:
            self.top_logprobs[slot] = -1
            self.num_logprobs -= 1
        self._free.append(slot)

    def constrained(self, slots: np.ndarray) -> tuple[np.ndarray, list]:
        """Of the rows `slots` (a step's sampled rows, in order): the positions of those with a
        grammar, and their matchers."""
        rows = np.flatnonzero(self._constrained[slots])
        return rows, [self._matchers[s] for s in slots[rows].tolist()]

    def stage_tables(self, seqs) -> None:
        """Blocks the requests took since their rows were last staged, into their block table
        rows (a decode row takes a block every `block_size` steps; entries past a request's own
        blocks are stale and never read: the kernel stops at each token's length)."""
        table, staged = self._host_tables_np, self._staged
        for seq in seqs:
            slot, blocks = seq.slot, seq.blocks
            done = staged[slot]
            if len(blocks) > done:
                table[slot, done : len(blocks)] = blocks[done:]
                staged[slot] = len(blocks)
                self._tables_dirty = True

    def upload(self) -> None:
        """Changed rows to the device: the sampling table (a blocking copy of a few KB, on steps
        that admitted a request) and the block tables (one contiguous non-blocking copy: the
        runner keeps the pinned host side unwritten until it has been read)."""
        self.sampling.upload()
        if self._tables_dirty:
            if self.block_tables is not self.host_tables:
                self.block_tables.copy_(self.host_tables, non_blocking=True)
            self._tables_dirty = False
