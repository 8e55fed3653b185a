"""The scheduler alone (no model): what runs each step, under the token budget and the lanes."""

from __future__ import annotations

import torch

from shared.streams import SamplingParams
from worker.engine.engine import EngineRequest
from worker.engine.kv_cache import SlotKVCache
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence


def _scheduler(slots=4, budget=1000, chunk=16, aging=4):
    cache = SlotKVCache(layers=1, slots=slots, kv_heads=1, max_seq_len=8, head_dim=2, dtype=torch.float32,
                        device="cpu")
    return Scheduler(cache, budget, chunk, aging)


_arrivals = iter(range(10**6))


def _seq(prompt_len, lane="interactive", max_tokens=10):
    req = EngineRequest(f"r{prompt_len}-{lane}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                        priority=lane)
    return Sequence(req=req, reserve=prompt_len + max_tokens, detok=None, generator=None,
                    arrival=next(_arrivals), tokens=list(req.prompt_ids))


def _advance(plan):
    """What the engine does after a step: computed moves on, sampled requests get a token."""
    for s in plan.decode:
        s.computed += 1
    for s, n in plan.prefill:
        s.computed += n
    for s in plan.sampled:
        s.tokens.append(0)


def test_decodes_get_one_token_each_and_prompts_share_the_chunk_budget():
    sched = _scheduler(chunk=16)
    a, b = _seq(10), _seq(30)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [(s, n) for s, n in plan.prefill] == [(a, 10), (b, 6)] and plan.sampled == [a]
    _advance(plan)
    plan = sched.schedule()
    assert plan.decode == [a] and plan.prefill == [(b, 16)] and plan.sampled == [a]
    _advance(plan)
    plan = sched.schedule()
    assert plan.decode == [a] and plan.prefill == [(b, 8)] and plan.sampled == [a, b]


def test_admission_is_strict_in_lane_order_and_frees_on_remove():
    sched = _scheduler(slots=4, budget=60)
    first = _seq(20, max_tokens=10)
    big, small = _seq(40, max_tokens=10), _seq(5, max_tokens=5)
    for s in (first, big, small):
        sched.add(s)
    sched.schedule()
    assert sched.running == [first] and sched.waiting == [big, small]  # small does not jump ahead
    sched.remove(first)
    assert sched.budget.used == 0 and sched.cache.num_free == 4
    sched.schedule()
    assert sched.running == [big, small]


def test_aged_batch_request_is_admitted_ahead_of_interactive_ones():
    sched = _scheduler(slots=1, aging=3)
    running = _seq(4)
    sched.add(running)
    sched.schedule()
    batch = _seq(4, lane="batch")
    sched.add(batch)
    for _ in range(3):
        sched.schedule()
    chat = _seq(4)
    sched.add(chat)
    sched.remove(running)
    sched.schedule()
    assert sched.running == [batch] and sched.waiting == [chat]
