"""Prefix caching (worker/engine/block_pool.py, kv_cache_manager.py and the scheduler's use of
it): the block pool's invariants under random operations, what the scheduler admits and computes
when a prefix is cached, and the engine's outputs, which must be exactly those without the cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.sampling import SamplingParams
from tests.engine_families import FAMILIES, assert_prefix_caching_exact
from worker.engine import Engine, EngineConfig, EngineRequest
from worker.engine.block_pool import BlockPool, extend_names, prefix_root
from worker.engine.kv_cache_manager import KVCacheManager
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence


# ---- the block pool alone --------------------------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["new", "grow", "publish", "release"]), st.integers(0, 2),
                         st.integers(0, 6)), max_size=120)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ops=OPS, num_blocks=st.integers(1, 12))
def test_block_pool_invariants_under_random_operations(ops, num_blocks):
    """Holders (requests) hit, allocate, publish and release at random. After every operation a
    block's refcount is the number of holders that hold it, free + cached + used = all, the
    cached set is exactly the named blocks nobody holds, no block is handed out while held, and a
    hit returns only blocks whose contents are still what their names say (an evicted block's
    name is gone before anyone overwrites it)."""
    pool = BlockPool(num_blocks, caching=True)
    holders: dict[int, tuple[int, list[int]]] = {}   # id -> (prefix it computes, its blocks)
    contents: dict[int, tuple[int, int]] = {}         # block -> (prefix, index) written into it
    name = lambda prefix, i: prefix_root(prefix, i)   # noqa: E731 - block i of prefix `prefix`
    next_id = 0
    for op, prefix, k in ops:
        if op == "new":   # a request: the longest cached run of its prefix, then k fresh blocks
            hit = pool.cached_prefix(name(prefix, i) for i in range(num_blocks))
            for i, block in enumerate(hit):
                assert contents[block] == (prefix, i), "a hit returned a block that was overwritten"
            pool.take(hit)
            holders[next_id] = (prefix, list(hit))
            op, holder = "grow", next_id
            next_id += 1
        elif holders:
            holder = sorted(holders)[k % len(holders)]
        else:
            continue
        if op == "grow":
            prefix, blocks = holders[holder]
            n = min(k, pool.num_free)
            held_elsewhere = {b for h, (_, bs) in holders.items() for b in bs}
            fresh = pool.allocate(n)
            assert not set(fresh) & held_elsewhere, "a held block was handed out"
            for block in fresh:
                contents[block] = (prefix, len(blocks))
                blocks.append(block)
        elif op == "publish":   # its blocks' KV is written: they may be shared
            prefix, blocks = holders[holder]
            for i, block in enumerate(blocks):
                pool.publish(block, name(prefix, i))
        elif op == "release":
            pool.release(holders.pop(holder)[1])
        pool.check()
        counts = [0] * num_blocks
        for _, blocks in holders.values():
            for block in blocks:
                counts[block] += 1
        assert counts == pool.refs
        assert pool.num_used == sum(c > 0 for c in counts)
        assert pool.num_free + pool.num_used == num_blocks


def test_block_pool_evicts_cached_blocks_only_when_nothing_is_free_least_recent_first():
    pool = BlockPool(6, caching=True)
    a, b = pool.allocate(2), pool.allocate(2)
    assert a == [0, 1] and b == [2, 3]
    for i, block in enumerate(a + b):
        pool.publish(block, bytes([i]))
    pool.release(a)
    pool.release(b)
    assert pool.num_free == 6 and pool.num_cached == 4
    assert pool.allocate(2) == [4, 5]              # plain free blocks first
    # then cached ones, least recently released first; within a request, its tail before its head
    assert pool.allocate(3) == [1, 0, 3]
    assert pool.cached_prefix([bytes([2]), bytes([3])]) == [2]   # block 3 was evicted, its name gone
    assert pool.cached_prefix([bytes([0])]) == []


def test_a_hit_stops_at_the_first_evicted_block():
    """A chain whose middle block was evicted while a later one stayed cached (computed twice,
    by two requests) is a hit up to the gap only: a later block must never move up into it."""
    pool = BlockPool(5, caching=True)
    n0, n1, n2 = b"n0", b"n1", b"n2"
    a = pool.allocate(2)                  # request A computes blocks 0-1 of the prefix
    b = pool.allocate(3)                  # B computed the same meanwhile, and one block more
    for block, name in zip(a, (n0, n1)):
        pool.publish(block, name)
    for block, name in zip(b, (n0, n1, n2)):
        pool.publish(block, name)         # its first two are duplicates: they stay unnamed
    pool.release(a)
    pool.release(b)
    assert pool.num_cached == 3 and pool.cached_prefix([n0, n1, n2]) == a + [b[2]]
    pool.allocate(3)                      # B's two unnamed blocks, then A's tail (n1) is evicted
    assert pool.cached_prefix([n0, n1, n2]) == [a[0]]
    pool.check()


def test_block_pool_without_caching_is_a_plain_free_list():
    pool = BlockPool(4, caching=False)
    blocks = pool.allocate(3)
    pool.release(blocks)
    assert pool.num_cached == 0 and pool.allocate(4) == [0, 1, 2, 3]


def test_names_chain_every_block_to_its_whole_prefix():
    """A block's name stands for all the tokens up to its end: the same ids after a different
    prefix, or in another model (root), get a different name; names are extended incrementally."""
    root = prefix_root("model", "float32")
    tokens = list(range(100, 112))
    names: list[bytes] = []
    extend_names(names, root, tokens, 4, 2)
    extend_names(names, root, tokens, 4, 3)
    again: list[bytes] = []
    extend_names(again, root, tokens, 4, 3)
    assert names == again and len(set(names)) == 3
    other: list[bytes] = []
    extend_names(other, root, [99] + tokens[1:], 4, 3)   # only the first token differs
    assert all(x != y for x, y in zip(names, other))
    elsewhere: list[bytes] = []
    extend_names(elsewhere, prefix_root("model", "bfloat16"), tokens, 4, 3)
    assert not set(elsewhere) & set(names)


# ---- the scheduler with a caching pool (no model) ---------------------------------------------

def _scheduler(rows=4, blocks=64, block_size=4, chunk=16):
    return Scheduler(KVCacheManager(BlockPool(blocks, caching=True), block_size), rows, chunk, 8)


def _seq(tokens, rid="r"):
    req = EngineRequest(rid, list(tokens), SamplingParams(max_tokens=8))
    return Sequence(req=req, detok=None, generator=None, arrival=0, tokens=list(tokens))


def _advance(sched, plan):
    """What the engine has the scheduler do after a successful step (computed moves on, blocks
    are published, sampled requests get a token: 0)."""
    sched.update_from_output(plan, [0] * len(plan.sampled))


def _finish(sched, seq) -> list[int]:
    """Run `seq` through its prompt, then let it end; returns the blocks it held."""
    while seq.pending > 1 or seq.computed == 0:
        _advance(sched, sched.schedule())
    held = list(seq.blocks)
    sched.remove(seq)
    return held


def test_a_cached_prefix_is_taken_and_only_the_rest_prefilled():
    sched = _scheduler()
    first = _seq(range(1, 21), "first")            # 5 blocks of 4
    sched.add(first)
    held = _finish(sched, first)
    assert sched.kv.pool.num_cached == 5 and sched.kv.prefix_hits == 0 and sched.kv.prefix_queries == 20
    second = _seq(list(range(1, 13)) + [99, 98], "second")   # shares 3 blocks
    sched.add(second)
    plan = sched.schedule()
    assert second.blocks[:3] == held[:3] and held[3] not in second.blocks
    assert plan.prefill == [(second, 2)] and second.cached_tokens == 12
    assert sched.kv.prefix_hits == 12 and sched.kv.prefix_queries == 34


def test_the_block_of_the_last_token_is_computed_in_a_fresh_block():
    """An identical prompt: every block is cached, but the last one holds the token whose logits
    are needed; it is recomputed into a block of its own, the cached one is not written."""
    sched = _scheduler()
    first = _seq(range(1, 17), "first")            # exactly 4 blocks
    sched.add(first)
    plan = sched.schedule()
    assert plan.prefill == [(first, 16)]
    _advance(sched, plan)
    cached_last = first.blocks[3]
    again = _seq(range(1, 17), "again")
    sched.add(again)
    plan = sched.schedule()
    assert (again, 4) in plan.prefill and again.computed == 12
    assert again.blocks[:3] == first.blocks[:3] and again.blocks[3] != cached_last
    assert [sched.kv.pool.refs[b] for b in first.blocks[:3]] == [2, 2, 2]


def test_admission_does_not_count_the_hits_idle_blocks_twice():
    """The hit's blocks nobody holds are counted as free; taking them uses them up. A request
    whose hit is idle and whose first chunk needs more blocks than are left waits."""
    sched = _scheduler(blocks=6, chunk=16)
    first = _seq(range(1, 21), "first")            # 5 blocks, cached once it ends
    sched.add(first)
    _finish(sched, first)
    assert sched.kv.pool.num_free == 6 and sched.kv.pool.num_cached == 5
    big = _seq(list(range(1, 21)) + [50] * 8, "big")   # hits 5 idle blocks, needs 2 more: only 1 left
    sched.add(big)
    sched.schedule()
    assert big in sched.waiting and big.blocks == [] and sched.kv.pool.num_cached == 5
    small = _seq(list(range(1, 21)) + [50] * 3, "small")   # hits 5, needs 1 more: fits
    sched.waiting.clear()
    sched.add(small)
    plan = sched.schedule()
    assert plan.prefill == [(small, 3)] and sched.kv.pool.num_free == 0


def test_a_request_waits_a_step_for_the_block_another_one_fills_now():
    """Two identical prompts arriving together: the second does not compute the blocks the
    first computes this step; it takes them the next step, and prefills only its last block."""
    sched = _scheduler(chunk=64)
    a, b = _seq(range(1, 25), "a"), _seq(range(1, 25), "b")
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert plan.prefill == [(a, 24)] and b in sched.running and b.computed == 0
    _advance(sched, plan)
    plan = sched.schedule()
    assert plan.prefill == [(b, 4)] and b.cached_tokens == 20 and b.blocks[:5] == a.blocks[:5]


def test_preemption_releases_shared_blocks_and_the_victim_takes_its_own_back():
    sched = _scheduler(blocks=8, chunk=16)
    chat, batch = _seq(range(1, 13), "chat"), _seq(range(1, 13), "batch")
    batch.lane = "batch"
    sched.add(chat)
    _advance(sched, sched.schedule())                  # chat: 3 blocks, published
    sched.add(batch)
    _advance(sched, sched.schedule())                  # batch: hits 2, computes its last block
    assert batch.cached_tokens == 8 and [sched.kv.pool.refs[b] for b in chat.blocks[:2]] == [2, 2]
    for _ in range(20):                                # decode until the 8-block pool runs out
        plan = sched.schedule()
        if plan.preempted:
            break
        _advance(sched, plan)
    assert plan.preempted == [batch] and batch.blocks == [] and batch.computed == 0
    assert all(sched.kv.pool.refs[b] == 1 for b in chat.blocks)
    sched.kv.pool.check()


# ---- the engine: exact outputs with the cache ------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_prefix_caching_equals_generate(family):
    """Requests sharing no block, one, many, all but the last token's, and all of them, joining
    while others prefill and decode; one cancelled in the middle of a prefill others share; a
    failover continuation whose context hits the blocks an earlier request generated; with a
    roomy pool, with one that forces preemptions, and with the cache off: each request's greedy
    tokens are generate()'s alone (sliding windows included)."""
    torch.manual_seed(0)
    assert_prefix_caching_exact(FAMILIES[family]().eval(), 12, family)


def _generate(model, prompt, n):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             pad_token_id=model.config.pad_token_id)
    return out[0, len(prompt):].tolist()


def _run(engine, req):
    """One request to its end alone; (tokens, outputs)."""
    engine.add(req)
    outs = []
    while engine.has_work:
        outs.extend(o for o in engine.step() if o.rid == req.rid)
    return [t for o in outs for t in o.token_ids], outs


def test_cached_tokens_are_reported_and_the_counters_add_up(model, tokenizer):
    system = tokenizer("You are a helpful assistant. Answer briefly and politely. " * 4)["input_ids"]
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=512, prefill_chunk=32))
    bs = engine.cache.block_size
    prompts = [system + tokenizer(q, add_special_tokens=False)["input_ids"]
               for q in ("What is 2 + 2?", "Name a colour.", "Why is the sky blue?")]
    reported = []
    for i, prompt in enumerate(prompts):
        tokens, outs = _run(engine, EngineRequest(f"q{i}", prompt, SamplingParams(max_tokens=6, temperature=0.0)))
        assert tokens == _generate(model, prompt, 6)
        assert all(o.cached_tokens == 0 for o in outs[:-1])   # the final carries it
        reported.append(outs[-1].cached_tokens)
    assert reported == [0, len(system) // bs * bs, len(system) // bs * bs]
    assert engine.prefix_cache_hits == sum(reported)
    assert engine.prefix_cache_queries == sum(map(len, prompts))
    assert engine.kv_tokens_used == 0 and engine.kv_tokens_cached > 0
    assert engine.cache.num_free == engine.cache.num_blocks


def test_the_next_turn_of_a_conversation_hits_the_previous_answer(model, tokenizer):
    """Blocks filled by generated tokens are cached too: turn 2's prompt (turn 1's prompt, its
    answer, a new message) takes everything up to the answer's last computed token."""
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=512, prefill_chunk=16))
    bs = engine.cache.block_size
    turn1 = tokenizer("Tell me a story about a lighthouse keeper.")["input_ids"]
    answer, _ = _run(engine, EngineRequest("t1", turn1, SamplingParams(max_tokens=40, temperature=0.0)))
    turn2 = turn1 + answer + tokenizer(" And then?", add_special_tokens=False)["input_ids"]
    tokens, outs = _run(engine, EngineRequest("t2", turn2, SamplingParams(max_tokens=8, temperature=0.0)))
    # turn 1 computed its prompt and all but its last answer token
    assert outs[-1].cached_tokens == (len(turn1) + len(answer) - 1) // bs * bs > len(turn1)
    assert tokens == _generate(model, turn2, 8)


def test_a_failed_forward_pass_publishes_nothing(model, tokenizer, monkeypatch):
    """Blocks become shareable only after the pass that writes them succeeded: a request with
    the same prompt after a failure computes it again (and equals generate)."""
    prompt = tokenizer("The quick brown fox jumps over the lazy dog. " * 3)["input_ids"]
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256, prefill_chunk=256))
    engine.add(EngineRequest("a", prompt, SamplingParams(max_tokens=4, temperature=0.0)))
    from worker.engine import attention
    with monkeypatch.context() as patch:
        patch.setattr(attention, "attend", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("oom")))
        outs = engine.step()
    assert [o.finish_reason for o in outs] == ["error"]
    assert engine.kv_tokens_cached == 0 and engine.cache.pool.num_cached == 0
    tokens, outs = _run(engine, EngineRequest("b", prompt, SamplingParams(max_tokens=4, temperature=0.0)))
    assert outs[-1].cached_tokens == 0 and tokens == _generate(model, prompt, 4)


def test_cached_blocks_give_way_to_new_tokens(model, tokenizer):
    """A pool full of cached prefixes is still a free pool: a request that needs all of it runs
    (evicting them), and the up-front check (the whole pool alone) is unchanged."""
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256, kv_cache_tokens=128,
                                                   prefill_chunk=64))
    for i in range(3):
        _run(engine, EngineRequest(f"fill{i}", tokenizer(f"Request number {i} says hello. " * 6)["input_ids"],
                                   SamplingParams(max_tokens=8, temperature=0.0)))
    assert engine.cache.pool.num_cached >= 4 and engine.cache.num_free == engine.cache.num_blocks
    prompt = tokenizer("A long prompt that fills the pool. " * 8)["input_ids"]
    n = 128 - len(prompt)
    tokens, outs = _run(engine, EngineRequest("big", prompt, SamplingParams(max_tokens=n, temperature=0.0),
                                              ignore_eos=True))
    assert len(tokens) == n and outs[-1].finish_reason == "length" and engine.preemptions == 0
    assert tokens[:8] == _generate(model, prompt, 8)


def test_requests_share_blocks_only_within_a_cache_salt(model, tokenizer):
    prompt = tokenizer("A shared system prompt for everyone here. " * 3)["input_ids"]
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    cached = {}
    for rid, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1"), ("d", "")):
        cached[rid] = _run(engine, EngineRequest(rid, prompt, params, cache_salt=salt))[1][-1].cached_tokens
    assert cached["a"] == cached["b"] == cached["d"] == 0 and cached["c"] > 0


def test_prefix_caching_off_keeps_nothing(model, tokenizer):
    prompt = tokenizer("The same prompt twice over. " * 3)["input_ids"]
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256, prefix_caching=False))
    for rid in ("a", "b"):
        tokens, outs = _run(engine, EngineRequest(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0)))
        assert outs[-1].cached_tokens == 0 and tokens == _generate(model, prompt, 4)
    assert engine.prefix_cache_hits == 0 and engine.kv_tokens_cached == 0 and engine.cache.pool.num_cached == 0


def test_settings_carry_prefix_caching_into_the_engine_config():
    from shared.config import Settings
    assert EngineConfig().prefix_caching is True
    assert EngineConfig.from_settings(Settings(device="cpu", quantization="none")).prefix_caching is True
    assert EngineConfig.from_settings(Settings(device="cpu", quantization="none", prefix_caching=False)).prefix_caching is False
