"""Scheduling: which requests run this step and how many tokens each gets (vLLM v1's shape: the
scheduler decides, the runner executes, the engine updates).

Admission: a request reserves prompt + max_tokens KV tokens and a cache slot when admitted, so a
running request can always finish (memory never runs out mid-stream, nothing is preempted). A
request whose reservation exceeds the whole budget (or one slot) is refused up front by the
engine; one that fits later waits. Admission is strict: if the first request in lane order does
not fit yet, nothing behind it jumps ahead, so large requests are not starved by small ones.

Lanes: every step, every decoding request gets its one token. Prompt tokens (at most
`prefill_chunk` a step) and admission are handed out in lane order, interactive first, FIFO
within a lane. Aging keeps batch work moving under a steady interactive load: a request that
got nothing for `aging_steps` consecutive steps is served as if it were interactive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.kv_cache import SlotKVCache
from worker.engine.sequence import Sequence

LANES = ("interactive", "batch")


@dataclass
class StepPlan:
    """What one forward pass computes."""
    decode: list[Sequence] = field(default_factory=list)                 # one token each, slot order
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)    # (request, tokens)
    # requests whose context is complete after this step: they get a new token, in the order
    # of the rows the runner samples (decode rows first, then completed prefills)
    sampled: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def scheduled(self) -> list[Sequence]:
        return self.decode + [s for s, _ in self.prefill]


class TokenBudget:
    """KV-cache tokens reserved by running requests."""

    def __init__(self, total: int):
        self.total = total
        self.used = 0

    def fits(self, tokens: int) -> bool:
        return self.used + tokens <= self.total

    def reserve(self, tokens: int) -> None:
        self.used += tokens

    def release(self, tokens: int) -> None:
        self.used -= tokens


class Scheduler:
    def __init__(self, cache: SlotKVCache, budget_tokens: int, prefill_chunk: int, aging_steps: int):
        self.cache = cache
        self.budget = TokenBudget(budget_tokens)
        self.prefill_chunk = prefill_chunk
        self.aging_steps = aging_steps
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

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
            self.cache.release(seq.slot)
            self.budget.release(seq.reserve)
            seq.slot = -1

    def schedule(self) -> StepPlan:
        self._admit()
        plan = StepPlan()
        plan.decode = sorted((s for s in self.running if s.pending == 1 and s.computed > 0), key=lambda s: s.slot)
        room = self.prefill_chunk
        prefilling = sorted((s for s in self.running if not (s.pending == 1 and s.computed > 0)), key=self._priority)
        for seq in prefilling:
            if room == 0:
                seq.starved += 1
                continue
            n = min(seq.pending, room)
            plan.prefill.append((seq, n))
            room -= n
            seq.starved = 0
        for seq in self.waiting:
            seq.starved += 1
        plan.sampled = plan.decode + [s for s, n in plan.prefill if s.computed + n == len(s.tokens)]
        return plan

    def _admit(self) -> None:
        self.waiting.sort(key=self._priority)
        while self.waiting and self.cache.num_free:
            seq = self.waiting[0]
            if not self.budget.fits(seq.reserve):
                return
            self.waiting.pop(0)
            seq.slot = self.cache.allocate()
            seq.starved = 0
            self.budget.reserve(seq.reserve)
            self.running.append(seq)
