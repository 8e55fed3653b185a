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

Prefix caching (when the pool caches, block_pool.py): a request whose computed prefix ends at a
block boundary first takes the cached blocks that continue it, on admission and again whenever
its prompt is next scheduled (a request that waited for the prefill budget then finds what an
identical one computed meanwhile), and prefills only the rest. The block holding its last
context token is never taken (its logits are needed; recomputing that block in a fresh one is
exact and writes nothing shared). A request whose next block another request computes in this
very step waits a step and then takes it, instead of computing it twice. Blocks are published
(named in the pool) only after the forward pass that wrote them succeeded (`cache_computed`), so a
failed step leaves no half-written block shareable. Admission counts a request's hit: it needs
blocks only for what follows it, and the hit's blocks nobody held come out of the free count.
Shared blocks stay correct through preemption and cancel: releasing drops one reference, and a
block nobody holds stays cached (counted free) until it is evicted for new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

from worker.engine.block_pool import extend_names
from worker.engine.kv_cache import PagedKVCache, blocks_for
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

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def scheduled(self) -> list[Sequence]:
        return self.decode + [s for s, _ in self.prefill]


class Scheduler:
    def __init__(self, cache: PagedKVCache, max_running: int, prefill_chunk: int, aging_steps: int):
        self.cache = cache
        self.pool = cache.pool
        self.caching = cache.pool.caching
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.aging_steps = aging_steps
        # Blocks admission leaves free for running requests' next tokens, so a new request does
        # not cause a preemption on its very next step (vLLM's watermark, 1%).
        self.watermark = cache.num_blocks // 100
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_running - 1, -1, -1))   # rows of the runner's tables (Sequence.slot)
        self.preemptions = 0    # total, for metrics
        # prefix cache hit rate (totals, for metrics, as vLLM's prefix_cache_queries / _hits):
        # context tokens of requests admitted for the first time, and how many of those were
        # taken from the cache instead of computed (recomputes after preemption count in neither)
        self.prefix_queries = 0
        self.prefix_hits = 0

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
            self._release(seq)

    def schedule(self) -> StepPlan:
        self._admit()
        plan = StepPlan()
        room = self.prefill_chunk
        bs = self.cache.block_size
        order = sorted(self.running, key=self._priority)  # most urgent first
        computing: set[bytes] = set()   # names of the blocks this step's prompt chunks fill
        i = 0
        while i < len(order):
            seq = order[i]
            i += 1
            decoding = seq.pending == 1 and seq.computed > 0
            if self.caching and not decoding and seq.computed == len(seq.blocks) * bs:
                self._reuse(seq)
                nxt = len(seq.blocks)   # a block it could take next step: not its last token's
                if nxt < (len(seq.tokens) - 1) // bs and seq.block_names[nxt] in computing:
                    seq.starved += 1    # another request fills that block now: take it next step
                    continue
                decoding = seq.pending == 1 and seq.computed > 0
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
                if self.caching:
                    computing.update(seq.block_names[seq.computed // bs : (seq.computed + n) // bs])
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
        bs = self.cache.block_size
        while True:
            need = blocks_for(seq.computed + n, bs) - len(seq.blocks)
            if need <= self.pool.num_free:
                break
            if order[-1] is seq:
                n = min(n, (len(seq.blocks) + self.pool.num_free) * bs - seq.computed)
                if n <= 0:
                    return 0
                need = blocks_for(seq.computed + n, bs) - len(seq.blocks)
                break
            victim = order.pop()
            self._preempt(victim)
            plan.preempted.append(victim)
        if need > 0:
            seq.blocks.extend(self.pool.allocate(need))
        return n

    def cache_computed(self, plan: StepPlan) -> None:
        """Publish the blocks this step's forward pass filled, prompt and generated tokens alike
        (the engine calls it once the pass succeeded and `computed` has moved on): from now on
        other requests may share them."""
        bs = self.cache.block_size
        for seq in plan.decode:
            if seq.computed >= (seq.published + 1) * bs:
                self._publish(seq)
        for seq, _ in plan.prefill:
            if seq.computed >= (seq.published + 1) * bs:
                self._publish(seq)

    def _publish(self, seq: Sequence) -> None:
        bs = self.cache.block_size
        full = seq.computed // bs
        if len(seq.block_names) < full:
            extend_names(seq.block_names, seq.cache_root, seq.tokens, bs, full)
        for i in range(seq.published, full):
            self.pool.publish(seq.blocks[i], seq.block_names[i])
        seq.published = full

    def _hit(self, seq: Sequence) -> list[int]:
        """The cached blocks continuing `seq`'s blocks (all computed, ending at a block
        boundary), up to but never including the block of its last context token."""
        bs = self.cache.block_size
        limit = (len(seq.tokens) - 1) // bs
        start = len(seq.blocks)
        if start >= limit:
            return []
        if len(seq.block_names) < limit:
            extend_names(seq.block_names, seq.cache_root, seq.tokens, bs, limit)
        return self.pool.cached_prefix(islice(seq.block_names, start, limit))

    def _reuse(self, seq: Sequence, hit: list[int] | None = None) -> None:
        """Take `hit` (default: `_hit(seq)`) into `seq`'s blocks: computed without computing."""
        if hit is None:
            hit = self._hit(seq)
        if not hit:
            return
        self.pool.take(hit)
        seq.blocks.extend(hit)
        seq.computed += len(hit) * self.cache.block_size
        seq.published = len(seq.blocks)
        if seq.preemptions == 0:
            seq.cached_tokens += len(hit) * self.cache.block_size
            self.prefix_hits += len(hit) * self.cache.block_size

    def _preempt(self, seq: Sequence) -> None:
        """Take a running request's blocks back; it waits and recomputes its whole context."""
        self.running.remove(seq)
        self._release(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.published = 0
        if seq.slot >= 0:
            self._free_slots.append(seq.slot)
        seq.slot, seq.staged_blocks = -1, 0

    def _admit(self) -> None:
        self.waiting.sort(key=self._priority)
        promised = 0  # blocks the requests admitted now will take for their first chunk
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            hit = self._hit(seq) if self.caching else []
            # the hit's blocks nobody holds count as free now, and taking them uses them up
            idle = sum(1 for block in hit if self.pool.refs[block] == 0)
            rest = len(seq.tokens) - len(hit) * self.cache.block_size
            first_chunk = blocks_for(min(rest, self.prefill_chunk), self.cache.block_size)
            if promised + first_chunk + self.watermark > self.pool.num_free - idle:
                return
            promised += first_chunk
            self.waiting.pop(0)
            if seq.preemptions == 0:
                self.prefix_queries += len(seq.tokens)
            self._reuse(seq, hit)
            seq.starved = 0
            seq.slot = self._free_slots.pop()
            self.running.append(seq)
