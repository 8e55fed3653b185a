"""The scheduler alone (no model): what runs each step, under the paged KV pool and the lanes."""

from __future__ import annotations

import torch

from shared.sampling import SamplingParams
from worker.engine.block_pool import BlockPool
from worker.engine.engine import EngineRequest
from worker.engine.input_batch import InputBatch
from worker.engine.kv_cache_manager import KVCacheManager
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence


def _scheduler(rows=4, blocks=250, block_size=4, chunk=16, aging=4):
    return Scheduler(KVCacheManager(BlockPool(blocks, caching=False), block_size), rows, chunk, aging)


_arrivals = iter(range(10**6))


def _seq(prompt_len, lane="interactive", max_tokens=10):
    req = EngineRequest(f"r{prompt_len}-{lane}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                        priority=lane)
    return Sequence(req=req, detok=None, generator=None, arrival=next(_arrivals), tokens=list(req.prompt_ids))


def _advance(sched, plan):
    """What the engine has the scheduler do after a step: computed moves on, sampled requests
    get a token (0)."""
    sched.update_from_output(plan, [0] * len(plan.sampled))


def test_decodes_get_one_token_each_and_prompts_share_the_chunk_budget():
    sched = _scheduler(chunk=16)
    a, b = _seq(10), _seq(30)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [(s, n) for s, n in plan.prefill] == [(a, 10), (b, 6)] and plan.sampled == [a]
    assert len(a.blocks) == 3 and len(b.blocks) == 2  # blocks for what is computed, 4 tokens each
    _advance(sched, plan)
    plan = sched.schedule()
    assert plan.decode == [a] and plan.prefill == [(b, 16)] and plan.sampled == [a]
    _advance(sched, plan)
    plan = sched.schedule()
    assert plan.decode == [a] and plan.prefill == [(b, 8)] and plan.sampled == [a, b]


def test_decode_rows_come_shortest_context_first():
    sched = _scheduler(chunk=64)
    long, short = _seq(40), _seq(5)
    sched.add(long)
    sched.add(short)
    _advance(sched, sched.schedule())
    plan = sched.schedule()
    assert plan.decode == [short, long]


def test_admission_is_strict_in_lane_order_and_frees_on_remove():
    sched = _scheduler(blocks=6, chunk=32)
    first = _seq(20)                 # 5 blocks of 4
    big, small = _seq(24), _seq(3)   # big's first chunk needs 6 blocks; small needs 1
    for s in (first, big, small):
        sched.add(s)
    sched.schedule()
    assert sched.running == [first] and sched.waiting == [big, small]  # small does not jump ahead
    sched.remove(first)
    assert sched.kv.num_free == 6 and first.blocks == []
    sched.schedule()
    assert sched.running == [big] and sched.waiting == [small]


def test_aged_batch_request_is_admitted_ahead_of_interactive_ones():
    sched = _scheduler(rows=1, aging=3)
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


def test_a_full_pool_preempts_the_least_urgent_request():
    sched = _scheduler(blocks=4, block_size=4, chunk=16)
    batch, chat = _seq(7, lane="batch"), _seq(7)   # 2 blocks each: the pool is full
    sched.add(batch)
    sched.add(chat)
    plan = sched.schedule()
    assert plan.prefill == [(chat, 7), (batch, 7)] and sched.kv.num_free == 0
    _advance(sched, plan)
    plan = sched.schedule()   # both decode position 7: still in their second block
    assert set(plan.decode) == {chat, batch} and not plan.preempted
    _advance(sched, plan)
    plan = sched.schedule()   # position 8 needs a third block each: the batch request yields
    assert plan.decode == [chat] and plan.preempted == [batch]
    assert batch in sched.waiting and batch.blocks == [] and batch.computed == 0 and batch.preemptions == 1
    assert len(batch.tokens) == 9   # its output so far stays: it is recomputed, not regenerated
    assert len(chat.blocks) == 3 and sched.preemptions == 1


def test_the_least_urgent_request_waits_rather_than_preempting_a_more_urgent_one():
    sched = _scheduler(blocks=4, block_size=4, chunk=16)
    chat, batch = _seq(8), _seq(4, lane="batch")
    sched.add(chat)
    sched.add(batch)
    _advance(sched, sched.schedule())   # chat: 2 blocks (full), batch: 1 block (full); 1 free
    plan = sched.schedule()      # chat takes the free block; batch has nothing to preempt below it
    assert plan.decode == [chat] and not plan.preempted and batch in sched.running
    assert batch.starved == 1 and len(batch.blocks) == 1


def test_a_prompt_chunk_shrinks_to_what_the_pool_holds():
    """A request that could never fit is refused by the engine; one that fits the pool alone but
    not with its whole next chunk, and has no one less urgent to preempt, computes what fits."""
    sched = _scheduler(blocks=3, block_size=4, chunk=4)
    seq = _seq(16)
    sched.add(seq)
    _advance(sched, sched.schedule())          # first chunk: 4 tokens, 1 block
    sched.prefill_chunk = 16            # a bigger chunk than the 2 free blocks hold
    plan = sched.schedule()
    assert plan.prefill == [(seq, 8)] and len(seq.blocks) == 3 and sched.kv.num_free == 0


def test_running_requests_hold_distinct_batch_rows_given_back_on_finish_and_preemption():
    """Each running request owns one row of the runner's batch (`slot`) while it runs: taken when
    the plan admits it, given back when the plan preempts it or when it ends, and a request admitted
    later reuses it from scratch (its block table row holds none of its blocks yet)."""
    sched = _scheduler(rows=3, blocks=12, block_size=4, chunk=64)
    batch = InputBatch(3, torch.device("cpu"), table_width=16, scratch_block=12)
    seqs = [_seq(8 + i, max_tokens=40) for i in range(4)]
    for s in seqs:
        sched.add(s)

    def step():
        plan = sched.schedule()
        batch.update(plan)
        batch.stage_tables(plan.scheduled)   # as the runner does
        return plan

    _advance(sched, step())
    running = sched.running
    assert len(running) == 3 and sorted(s.slot for s in running) == [0, 1, 2] and seqs[3].slot == -1
    assert batch.num_free == 0
    done = running[0]
    freed = done.slot
    sched.remove(done)
    batch.remove(done)                        # as the engine does when a request ends
    assert done.slot == -1 and batch.num_free == 1
    plan = sched.schedule()
    assert plan.admitted == [seqs[3]]
    batch.update(plan)
    assert seqs[3] in sched.running and seqs[3].slot == freed and batch._staged[freed] == 0
    batch.stage_tables(plan.scheduled)
    assert batch._staged[freed] == len(seqs[3].blocks)
    assert list(batch.host_tables[freed, :len(seqs[3].blocks)]) == seqs[3].blocks
    _advance(sched, plan)
    for _ in range(40):   # decode until the 12-block pool runs out and someone is preempted
        plan = step()
        for victim in plan.preempted:
            assert victim.slot == -1 and victim in sched.waiting
        _advance(sched, plan)
        slots = [s.slot for s in sched.running]
        assert -1 not in slots and len(set(slots)) == len(slots)
        assert batch.num_free == 3 - len(sched.running)
    assert sched.preemptions > 0
