"""Scheduling: which requests run this step and how many tokens each gets (vLLM v1's shape: the
scheduler decides, the runner executes, the engine updates).

KV memory is paged (`kv_cache.PagedKVCache`): a request takes blocks as its tokens are
scheduled, not a reservation up front. Admission is therefore optimistic: a request joins the
running set when a row is free (`max_running`) and the pool has blocks for its first prompt
chunk (plus a small watermark), so short requests are not held back by what long ones *might*
use. When the pool runs out, the least urgent running request is preempted: its blocks are
freed and it goes back to waiting with its tokens (prompt + output so far), to be recomputed by
prefill when it is admitted again (recompute preemption, as vLLM does by default; no swap
space). The most urgent request can always proceed, because a request that could not fit the
whole pool alone is refused up front by the engine, so every request eventually finishes.

Lanes: every step, every running request is served in priority order: interactive first, FIFO
(arrival) within a lane. A decoding request gets its one token; prompt tokens (at most
`prefill_chunk` a step) go in the same order, so chunked prefill keeps running streams getting a
token every step. Admission follows the same order and is strict: if the first waiting request
does not fit yet, nothing behind it jumps ahead. Aging keeps batch work moving under a steady
interactive load: a request that got nothing for `aging_steps` consecutive steps is served as if
it were interactive. Preemption victims are taken from the other end of that order.

Prefix caching and the KV blocks themselves are the `KVCacheManager`'s (kv_cache_manager.py): the
scheduler asks it for a prompt's computed blocks, for slots for the tokens it schedules, and frees
a request's blocks when it leaves or is preempted. After a forward pass, `update_from_output`
moves every scheduled request past what it computed, has the filled blocks published and appends
each sampled token to its request's context (what the token means, text and finish, is the
engine's). Rows of the runner's batch are the runner's (input_batch.py): the plan says which
requests joined (`admitted`) and left (`preempted`) the running set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.kv_cache import blocks_for
from worker.engine.kv_cache_manager import KVCacheManager
from worker.engine.sequence import Sequence

LANES = ("interactive", "batch")


@dataclass
class StepPlan:
    """What one forward pass computes."""
    decode: list[Sequence] = field(default_factory=list)                 # one token each, shortest context first
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)    # (request, tokens)
    # requests whose context is complete after this step: they get a new token, in the order
    # of the rows the runner samples (decode rows first, then completed prefills)
    sampled: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)              # sent back to waiting this step
    admitted: list[Sequence] = field(default_factory=list)               # joined the running set this step

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def scheduled(self) -> list[Sequence]:
        return self.decode + [s for s, _ in self.prefill]


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_running: int, prefill_chunk: int, aging_steps: int):
        self.kv = kv
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.aging_steps = aging_steps
        # Blocks admission leaves free for running requests' next tokens, so a new request does
        # not cause a preemption on its very next step (vLLM's watermark, 1%).
        self.watermark = kv.num_blocks // 100
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0    # total, for metrics

    def _priority(self, seq: Sequence) -> tuple[int, int]:
        urgent = seq.lane == "interactive" or seq.starved >= self.aging_steps
        return (0 if urgent else 1, seq.arrival)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a waiting or running request and free what it holds (idempotent)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.kv.free(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._admit(plan)
        room = self.prefill_chunk
        kv = self.kv
        kv.start_step()
        order = sorted(self.running, key=self._priority)  # most urgent first
        i = 0
        while i < len(order):
            seq = order[i]
            i += 1
            decoding = seq.pending == 1 and seq.computed > 0
            if not decoding:
                if not kv.take_computed(seq):
                    seq.starved += 1    # another request fills its next block now: take it next step
                    continue
                decoding = seq.pending == 1 and seq.computed > 0   # the cache may leave one token
            n = 1 if decoding else min(seq.pending, room)
            if n == 0:
                seq.starved += 1
                continue
            n = self._grow(seq, n, order, plan)
            if n == 0:  # the least urgent left and the pool is full: it waits, keeping its blocks
                seq.starved += 1
                continue
            seq.starved = 0
            if decoding:
                plan.decode.append(seq)
            else:
                plan.prefill.append((seq, n))
                room -= n
                kv.will_fill(seq, n)
        for seq in self.waiting:
            seq.starved += 1
        # Decode rows in context-length order: attention cuts them into segments of similar
        # length, so a long request does not make short ones attend over its length.
        plan.decode.sort(key=lambda s: s.computed)
        plan.sampled = plan.decode + [s for s, n in plan.prefill if s.computed + n == len(s.tokens)]
        return plan

    def _grow(self, seq: Sequence, n: int, order: list[Sequence], plan: StepPlan) -> int:
        """Blocks for `seq`'s next `n` tokens, preempting the least urgent requests after it in
        `order` while the pool is short. Returns how many tokens it may compute (a prompt chunk
        shrinks to what fits once there is nothing left to preempt; a decode token is all or
        nothing)."""
        kv = self.kv
        while not kv.allocate_slots(seq, n):
            if order[-1] is seq:
                n = min(n, kv.tokens_that_fit(seq))
                if n <= 0:
                    return 0
                kv.allocate_slots(seq, n)
                break
            victim = order.pop()
            self._preempt(victim)
            plan.preempted.append(victim)
        return n

    def update_from_output(self, plan: StepPlan, tokens: list[int]) -> None:
        """After a forward pass succeeded: every scheduled request moves past the tokens it
        computed, the blocks they filled are published (others may share them from now on), and
        each sampled request (`plan.sampled`, in the order of `tokens`) gets its new token."""
        for seq, token in zip(plan.decode, tokens):   # decode rows are the first sampled rows
            seq.computed += 1
            seq.tokens.append(token)
            seq.new_tokens += 1
        for seq, n in plan.prefill:
            seq.computed += n
        nd = len(plan.decode)
        for seq, token in zip(plan.sampled[nd:], tokens[nd:]):   # prompts completed this step
            seq.tokens.append(token)
            seq.new_tokens += 1
        self.kv.cache_computed(plan.decode, plan.prefill)

    def _preempt(self, seq: Sequence) -> None:
        """Take a running request's blocks back; it waits and recomputes its whole context."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.append(seq)

    def _admit(self, plan: StepPlan) -> None:
        self.waiting.sort(key=self._priority)
        kv, bs = self.kv, self.kv.block_size
        promised = 0  # blocks the requests admitted now will take for their first chunk
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            hit = kv.computed_blocks(seq)
            rest = len(seq.tokens) - len(hit) * bs
            first_chunk = blocks_for(min(rest, self.prefill_chunk), bs)
            if promised + first_chunk + self.watermark > kv.free_after(hit):
                return
            promised += first_chunk
            self.waiting.pop(0)
            kv.admit(seq, hit)
            seq.starved = 0
            self.running.append(seq)
            plan.admitted.append(seq)
