"""The continuous-batching engine on a tiny random Llama (real SmolLM2 tokenizer), in-process.

The model is built untied and with a wide init so greedy output does not degenerate into one
repeated token: equivalence with `model.generate` then really exercises the cache and masks.
"""

from __future__ import annotations

import types

import pytest
import torch

from shared.errors import ErrorCode
from shared.sampling import SamplingParams
from worker.engine import Engine, EngineConfig, EngineRejected, EngineRequest
from worker.engine.detokenize import IncrementalDetokenizer

PROMPTS = [
    "Hello there, how are you doing today?",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Hi",
    "Once upon a time, in a land far away, there lived a dragon who loved tea and long walks.",
    "1 2 3 4 5 6 7 8 9 10 11 12",
]


def ids(tokenizer, text):
    return tokenizer(text)["input_ids"]


def reference(model, prompt_ids, n):
    """`model.generate` greedy, one request alone."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=model.config.pad_token_id)
    return out[0, len(prompt_ids):].tolist()


def run(engine, schedule=None, max_steps=10_000):
    """Step until idle. `schedule` maps step number -> requests added before that step.
    Returns ({rid: [StepOutput]}, number of steps)."""
    schedule = dict(schedule or {})
    outs: dict[str, list] = {}
    step = 0
    while engine.has_work or schedule:
        for req in schedule.pop(step, []):
            engine.add(req)
        for o in engine.step():
            outs.setdefault(o.rid, []).append(o)
        step += 1
        assert step < max_steps
    return outs, step


def tokens(outs):
    return [t for o in outs for t in o.token_ids]


def text(outs):
    return "".join(o.text for o in outs)


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0)


def test_greedy_batched_equals_generate_alone(model, tokenizer):
    """Requests of different lengths joining at different steps, prompts spanning several
    prefill chunks, more requests than slots: each one's tokens equal generate() alone."""
    n = 24
    prompt_ids = [ids(tokenizer, p) for p in PROMPTS]
    assert max(map(len, prompt_ids)) > 3 * 8
    engine = Engine(model, tokenizer, EngineConfig(max_batch=3, max_seq_len=256, prefill_chunk=8))
    schedule = {0: [], 2: [], 5: [], 11: []}
    for i, (p, when) in enumerate(zip(prompt_ids, [0, 0, 2, 5, 11])):
        schedule[when].append(EngineRequest(f"r{i}", p, greedy(n)))
    outs, _ = run(engine, schedule)
    for i, p in enumerate(prompt_ids):
        got = outs[f"r{i}"]
        assert tokens(got) == reference(model, p, n), f"request r{i}"
        assert got[-1].finished and got[-1].finish_reason == "length"
        assert got[-1].completion_tokens == n and got[-1].prompt_tokens == len(p)
        assert sum(o.finished for o in got) == 1
    assert engine.num_running == 0 and engine.kv_tokens_used == 0 and engine.cache.num_free == engine.cache.num_blocks


def test_decode_continues_every_step_during_chunked_prefill(model, tokenizer):
    """A long prompt is prefilled over several steps while a running stream keeps getting one
    token per step (no stall), and prefill chunks never exceed prefill_chunk tokens."""
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=512, prefill_chunk=16))
    engine.add(EngineRequest("short", ids(tokenizer, "Hi"), greedy(60)))
    engine.step()  # prefill + first token of "short"
    long_prompt = ids(tokenizer, PROMPTS[1] * 3)
    engine.add(EngineRequest("long", long_prompt, greedy(4)))
    chunks_needed = -(-len(long_prompt) // 16)
    assert chunks_needed >= 4
    for step in range(chunks_needed):
        rids = [o.rid for o in engine.step()]
        assert rids.count("short") == 1, f"step {step}"
        assert ("long" in rids) == (step == chunks_needed - 1)
    seq = engine._by_rid["long"]
    assert seq.computed == len(long_prompt)


def test_seed_gives_same_output_regardless_of_companions(model, tokenizer):
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    prompt = ids(tokenizer, PROMPTS[0])
    alone, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=256)),
                   {0: [EngineRequest("a", prompt, params)]})
    engine = Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=256, prefill_chunk=8))
    crowd, _ = run(engine, {
        0: [EngineRequest("x", ids(tokenizer, PROMPTS[1]), SamplingParams(max_tokens=30, temperature=0.7, seed=9))],
        1: [EngineRequest("a", prompt, params)],
        3: [EngineRequest("y", ids(tokenizer, PROMPTS[3]), SamplingParams(max_tokens=10, temperature=1.2))],
    })
    assert tokens(alone["a"]) == tokens(crowd["a"])
    other, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=256)),
                   {0: [EngineRequest("a", prompt, SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9,
                                                                  top_k=50, seed=4321))]})
    assert tokens(other["a"]) != tokens(alone["a"])
    assert tokens(alone["a"]) != reference(model, prompt, 20)  # really sampled, not greedy


def test_top_k_1_equals_greedy(model, tokenizer):
    prompt = ids(tokenizer, PROMPTS[3])
    outs, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)),
                  {0: [EngineRequest("k1", prompt, SamplingParams(max_tokens=16, temperature=1.5, top_k=1))]})
    assert tokens(outs["k1"]) == reference(model, prompt, 16)


def test_top_p_tiny_equals_greedy(model, tokenizer):
    """top_p close to 0 keeps only the most likely token."""
    prompt = ids(tokenizer, PROMPTS[0])
    outs, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)),
                  {0: [EngineRequest("p", prompt, SamplingParams(max_tokens=16, temperature=1.0, top_p=1e-6))]})
    assert tokens(outs["p"]) == reference(model, prompt, 16)


def test_stop_string_ends_and_is_never_emitted(model, tokenizer):
    prompt = ids(tokenizer, PROMPTS[0])
    full, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)),
                  {0: [EngineRequest("f", prompt, greedy(40))]})
    full_text = text(full["f"])
    assert len(full_text) > 20
    stop = full_text[12:16]
    cut = full_text.find(stop)
    outs, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)),
                  {0: [EngineRequest("s", prompt, SamplingParams(max_tokens=40, temperature=0.0,
                                                                 stop=["never-appears", stop]))]})
    got = outs["s"]
    assert text(got) == full_text[:cut]
    assert got[-1].finish_reason == "stop" and got[-1].finished
    assert got[-1].completion_tokens < 40


def test_max_tokens_gives_length(model, tokenizer):
    outs, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)),
                  {0: [EngineRequest("m", ids(tokenizer, "Hi"), greedy(7))]})
    got = outs["m"]
    assert len(tokens(got)) == 7 and got[-1].completion_tokens == 7 and got[-1].finish_reason == "length"


def test_eos_ends_with_stop(model, tokenizer):
    """Any of the generation config's EOS ids ends the request (finish_reason "stop")."""
    prompt = ids(tokenizer, PROMPTS[0])
    ref = reference(model, prompt, 10)
    eos = ref[3]
    assert eos not in ref[:3]
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, eos]
    try:
        engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256))
    finally:
        model.generation_config.eos_token_id = saved
    outs, _ = run(engine, {0: [EngineRequest("e", prompt, greedy(10))]})
    got = outs["e"]
    assert tokens(got) == ref[:4]
    assert got[-1].finish_reason == "stop" and got[-1].completion_tokens == 4
    assert text(got) == tokenizer.decode(ref[:3], skip_special_tokens=True)


def test_cancel_frees_blocks(model, tokenizer):
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256))
    for rid in ("a", "b", "c"):
        engine.add(EngineRequest(rid, ids(tokenizer, PROMPTS[0]), greedy(100)))
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 1
    used = engine.kv_tokens_used
    held = -(-len(ids(tokenizer, PROMPTS[0])) // engine.cache.block_size) * engine.cache.block_size
    assert used == 2 * held  # blocks for what was computed, not for prompt + max_tokens
    assert engine.cancel("a") is True
    assert engine.num_running == 1 and engine.kv_tokens_used == used - held
    assert engine.cancel("a") is False and engine.cancel("nope") is False
    outs = engine.step()  # the cancel's final comes at once, without a forward pass
    assert [(o.rid, o.finish_reason, o.completion_tokens) for o in outs] == [("a", "cancelled", 1)]
    outs = engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 0  # "c" took the freed row
    assert "c" in {o.rid for o in outs}  # ... and was prefilled in that step
    # cancelling a waiting request
    engine.add(EngineRequest("d", ids(tokenizer, "Hi"), greedy(5)))
    assert engine.num_waiting == 1 and engine.cancel("d")
    assert engine.num_waiting == 0
    outs = engine.step()
    assert any(o.rid == "d" and o.finish_reason == "cancelled" and o.completion_tokens == 0 for o in outs)
    for rid in ("b", "c"):
        engine.cancel(rid)
    engine.step()
    assert not engine.has_work and engine.kv_tokens_used == 0 and engine.cache.num_free == engine.cache.num_blocks


def test_pool_rejects_what_never_fits(model, tokenizer):
    prompt = ids(tokenizer, "Hello there")
    engine = Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=128, kv_cache_tokens=96))
    assert engine.kv_tokens_total == 96 and engine.cache.num_blocks == 6
    with pytest.raises(EngineRejected) as exc:
        engine.add(EngineRequest("big", prompt, greedy(96 - len(prompt) + 1)))
    assert exc.value.code == ErrorCode.CONTEXT_TOO_LONG
    # longer than max_seq_len even though the pool could hold it
    wide = Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=64, kv_cache_tokens=1000))
    with pytest.raises(EngineRejected) as exc:
        wide.add(EngineRequest("long", prompt, greedy(64)))
    assert exc.value.code == ErrorCode.CONTEXT_TOO_LONG


def test_full_pool_preempts_the_least_urgent_which_recomputes_exactly(model, tokenizer):
    """Admission is optimistic: two requests that cannot both finish in a 96-token pool start
    together; when the pool runs out, the batch-lane one (though it came first) gives its blocks
    back and later recomputes its context. Both streams are exactly what they are alone: no token
    lost, repeated or changed, seeded sampling included, and each ends once."""
    n = 60
    p_batch, p_chat = ids(tokenizer, PROMPTS[0]), ids(tokenizer, PROMPTS[3])
    seeded = SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, seed=7)
    alone = Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=256))
    ref_batch, _ = run(alone, {0: [EngineRequest("b", p_batch, seeded, priority="batch", ignore_eos=True)]})
    engine = Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=128, kv_cache_tokens=96))
    engine.add(EngineRequest("b", p_batch, seeded, priority="batch", ignore_eos=True))
    engine.add(EngineRequest("i", p_chat, greedy(n), ignore_eos=True))
    outs: dict[str, list] = {}
    chat_waited_after_start = False
    steps = 0
    while engine.has_work:
        for o in engine.step():
            outs.setdefault(o.rid, []).append(o)
        waiting = {s.req.rid for s in engine.scheduler.waiting}
        chat_waited_after_start |= "i" in waiting and "i" in outs
        assert engine.kv_tokens_used <= engine.kv_tokens_total
        steps += 1
        assert steps < 1000
    assert engine.preemptions >= 1 and not chat_waited_after_start
    assert tokens(outs["i"]) == reference(model, p_chat, n)
    assert tokens(outs["b"]) == tokens(ref_batch["b"]) and text(outs["b"]) == text(ref_batch["b"])
    for rid in ("b", "i"):
        assert sum(o.finished for o in outs[rid]) == 1 and outs[rid][-1].finish_reason == "length"
        assert outs[rid][-1].completion_tokens == n
    assert engine.kv_tokens_used == 0 and engine.cache.num_free == engine.cache.num_blocks


def test_invalid_requests_are_rejected_without_harm(model, tokenizer):
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=128))
    engine.add(EngineRequest("ok", ids(tokenizer, "Hi"), greedy(3)))
    for req, code in [
        (EngineRequest("ok", ids(tokenizer, "Hi"), greedy(3)), ErrorCode.DUPLICATE_ID),
        (EngineRequest("empty", [], greedy(3)), ErrorCode.INVALID_REQUEST),
        (EngineRequest("bad", ids(tokenizer, "Hi"), SamplingParams(max_tokens=0)), ErrorCode.INVALID_REQUEST),
        (EngineRequest("oov", [1, len(tokenizer) + 5], greedy(3)), ErrorCode.INVALID_REQUEST),
        (EngineRequest("neg", [-1], greedy(3)), ErrorCode.INVALID_REQUEST),
        (EngineRequest("lane", [1], greedy(3), priority="urgent"), ErrorCode.INVALID_REQUEST),
    ]:
        with pytest.raises(EngineRejected) as exc:
            engine.add(req)
        assert exc.value.code == code
    outs, _ = run(engine)
    assert outs["ok"][-1].finish_reason == "length" and set(outs) == {"ok"}


def test_interactive_lane_admitted_before_batch(model, tokenizer):
    engine = Engine(model, tokenizer, EngineConfig(max_batch=1, max_seq_len=128))
    prompt = ids(tokenizer, "Hi")
    engine.add(EngineRequest("first", prompt, greedy(3)))
    engine.step()
    engine.add(EngineRequest("b1", prompt, greedy(2), priority="batch"))
    engine.add(EngineRequest("b2", prompt, greedy(2), priority="batch"))
    engine.add(EngineRequest("i1", prompt, greedy(2), priority="interactive"))
    order = []
    while engine.has_work:
        for o in engine.step():
            if o.rid not in order:
                order.append(o.rid)
    assert order == ["first", "i1", "b1", "b2"]


def test_skip_tokens_suppresses_already_delivered_output(model, tokenizer):
    """A replayed request regenerates the same tokens but emits only what follows the first
    `skip_tokens`; the two runs' texts join up exactly."""
    prompt = ids(tokenizer, PROMPTS[3])
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=7)
    full, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)),
                  {0: [EngineRequest("r", prompt, params)]})
    delivered = full["r"][:6]
    assert tokens(delivered) == tokens(full["r"])[:6]
    replay, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)),
                    {0: [EngineRequest("r", prompt, params, skip_tokens=6)]})
    assert tokens(replay["r"]) == tokens(full["r"])[6:]
    assert text(delivered) + text(replay["r"]) == text(full["r"])
    assert replay["r"][-1].completion_tokens == 20


@pytest.mark.parametrize("sample", ["👋🌍 你好，世界！ Ünïcödé ✨ 🎉🎉", "日本語のテキストと絵文字 🤖🦄"])
def test_detokenizer_never_emits_broken_utf8(tokenizer, sample):
    """Feeding the byte-level tokens of emoji/CJK text one by one: every emitted piece is
    complete text (no U+FFFD from split characters) and the pieces add up to the text."""
    token_ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
    assert len(token_ids) > len(sample) / 2  # many characters span several tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer("Say:")["input_ids"], stop=[])
    pieces = [detok.add(t) for t in token_ids] + [detok.finish()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == sample


def test_detokenizer_backend_decode_equals_transformers_decode(tokenizer):
    """The detokenizer calls the fast tokenizer's Rust backend directly (transformers' wrapper
    costs more than the decode); both must give the same text for any ids, special tokens,
    byte pieces and spaces before punctuation included."""
    detok = IncrementalDetokenizer(tokenizer, [], stop=[])
    assert detok._backend_decode is not None
    rng = torch.Generator().manual_seed(5)
    samples = [tokenizer("Hello , world ! 你好 👋 <|im_end|> x", add_special_tokens=False)["input_ids"]]
    samples += [torch.randint(0, len(tokenizer), (n,), generator=rng).tolist() for n in (1, 2, 5, 17, 60)]
    for sample in samples:
        for end in range(1, len(sample) + 1):
            ids_ = sample[:end]
            assert detok._decode(ids_) == tokenizer.decode(ids_, skip_special_tokens=True,
                                                           clean_up_tokenization_spaces=False)


def test_detokenizer_stream_releases_exactly_what_the_python_window_does(tokenizer):
    """Tokens go through the tokenizers library's Rust DecodeStream (one call per token); piece
    for piece it must release what our own two-decode window releases (same hold-back of split
    characters), also when it fails part-way and our window takes over from the same state."""
    rng = torch.Generator().manual_seed(11)
    samples = [tokenizer("Héllo , wörld ! 你好 👋🌍 <|im_end|> x  \n\n def f(): pass", add_special_tokens=False)["input_ids"]]
    samples += [torch.randint(0, len(tokenizer), (n,), generator=rng).tolist() for n in (3, 40, 300)]
    prompt = tokenizer("Say:")["input_ids"]
    for sample in samples:
        stream = IncrementalDetokenizer(tokenizer, prompt, stop=[])
        assert stream._stream is not None
        window = IncrementalDetokenizer(tokenizer, prompt, stop=[])
        window._stream = None
        broken = IncrementalDetokenizer(tokenizer, prompt, stop=[])
        pieces = {"stream": [], "window": [], "broken": []}
        for i, t in enumerate(sample):
            if i == len(sample) // 2:
                broken._stream = _RaisingStream()
            pieces["stream"].append(stream.add(t))
            pieces["window"].append(window.add(t))
            pieces["broken"].append(broken.add(t))
        for name, det in (("stream", stream), ("window", window), ("broken", broken)):
            pieces[name].append(det.finish())
        assert pieces["stream"] == pieces["window"] == pieces["broken"]
        assert "".join(pieces["stream"]) == tokenizer.decode(sample, skip_special_tokens=True,
                                                             clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("stop", [["<END>"], ["never", "the end of it all"]])
def test_a_stop_string_late_in_a_long_output_is_found_across_tokens(tokenizer, stop):
    """The detokenizer keeps only unreleased text plus the tail a stop string may begin in;
    a stop string thousands of characters in, spread over several tokens, is still found and
    nothing of it (nor anything after it) is released."""
    body = "Some words, ünïcode 你好 and 🙂 emoji. " * 150
    tail = stop[-1]
    token_ids = tokenizer(body + tail + " after the stop", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [], stop=stop)
    out = "".join(detok.add(t) for t in token_ids) + detok.finish()
    assert detok.stopped
    assert out == body
    assert len(detok.text) < 100


class _RaisingStream:
    def step(self, *_):
        raise Exception("DecodeStream: invalid prefix")


def test_detokenizer_holds_back_partial_stop_strings(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["END!"])
    emitted = ""
    for t in tokenizer("hello wor EN world END! tail", add_special_tokens=False)["input_ids"]:
        emitted += detok.add(t)
        assert not emitted.endswith(("E", "EN", "END")), "a possible stop-string start was released"
    assert detok.stopped
    assert emitted + detok.finish() == "hello wor EN world "


def test_sampled_emoji_prompt_output_is_whole_text(model, tokenizer):
    """Random sampling produces arbitrary byte tokens; the streamed pieces always equal the
    one-shot decode of the generated tokens, so no piece ever held a split character."""
    prompt = ids(tokenizer, "Translate 👋🌍 to 中文: 你好世界 🎉")
    outs, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)),
                  {0: [EngineRequest("u", prompt, SamplingParams(max_tokens=60, temperature=1.0, seed=3))]})
    got = outs["u"]
    assert text(got) == tokenizer.decode(tokens(got), skip_special_tokens=True)


# ---- every request ends exactly once, whatever raises ----------------------------------------

class _BrokenDetokenizer:
    """Stands in for one request's detokenizer and raises on its third token."""

    def __init__(self, real):
        self.real, self.calls = real, 0
        self.stopped = False

    def add(self, token):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("tokenizer exploded")
        return self.real.add(token)

    def finish(self):
        return self.real.finish()


def test_a_failing_detokenizer_fails_only_its_request(model, tokenizer):
    engine = Engine(model, tokenizer, EngineConfig(max_batch=3, max_seq_len=256))
    prompt = ids(tokenizer, PROMPTS[0])
    for rid in ("good", "bad", "also-good"):
        engine.add(EngineRequest(rid, prompt, greedy(8)))
    bad = engine._by_rid["bad"]
    bad.detok = _BrokenDetokenizer(bad.detok)
    outs, _ = run(engine)
    assert [o.finish_reason for o in outs["bad"] if o.finished] == ["error"]
    assert outs["bad"][-1].error_code == ErrorCode.INTERNAL and "exploded" in outs["bad"][-1].error_message
    for rid in ("good", "also-good"):
        assert tokens(outs[rid]) == reference(model, prompt, 8)
        assert sum(o.finished for o in outs[rid]) == 1
    assert not engine.has_work and engine.kv_tokens_used == 0 and engine.cache.num_free == engine.cache.num_blocks


def test_a_failing_forward_pass_fails_its_requests_and_keeps_the_engine(model, tokenizer, monkeypatch):
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256))
    engine.add(EngineRequest("a", ids(tokenizer, "Hi"), greedy(5)))
    engine.add(EngineRequest("b", ids(tokenizer, "Hi"), greedy(5)))
    engine.step()
    # fail in the middle of the forward pass (layer 0's attention, after its projections ran),
    # as a CUDA out-of-memory error would
    from worker.engine import attention
    with monkeypatch.context() as patch:
        patch.setattr(attention, "attend", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("oom")))
        decoder = getattr(engine.runner, "decoder", None)
        if getattr(decoder, "decode_layers", None) is not None:   # a CPU step of decode rows: one call, no `attend`
            patch.setattr(decoder, "decode_layers", types.SimpleNamespace(
                forward=lambda *a: (_ for _ in ()).throw(RuntimeError("oom"))))
        outs = engine.step()
    assert sorted((o.rid, o.finish_reason) for o in outs) == [("a", "error"), ("b", "error")]
    assert not engine.has_work and engine.cache.num_free == engine.cache.num_blocks and engine.kv_tokens_used == 0
    outs, _ = run(engine, {0: [EngineRequest("c", ids(tokenizer, "Hi"), greedy(5))]})
    assert tokens(outs["c"]) == reference(model, ids(tokenizer, "Hi"), 5)


def test_cancel_final_comes_before_the_next_forward_pass(model, tokenizer):
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256))
    engine.add(EngineRequest("a", ids(tokenizer, PROMPTS[0]), greedy(50)))
    engine.add(EngineRequest("b", ids(tokenizer, PROMPTS[0]), greedy(50)))
    engine.step()
    forwards = []
    handle = model.model.embed_tokens.register_forward_hook(lambda *a: forwards.append(1))  # once per forward
    try:
        engine.cancel("a")
        outs = engine.step()
        assert [(o.rid, o.finish_reason) for o in outs] == [("a", "cancelled")] and not forwards
        outs = engine.step()
        assert [o.rid for o in outs] == ["b"] and len(forwards) == 1
    finally:
        handle.remove()


# ---- continuation (failover): prompt + delivered tokens as context, only new tokens out -------

@pytest.mark.parametrize("params", [greedy(20), SamplingParams(max_tokens=20, temperature=0.9, top_k=40, seed=11)],
                         ids=["greedy", "seeded"])
def test_continuation_equals_the_uninterrupted_run(model, tokenizer, params):
    prompt = ids(tokenizer, PROMPTS[3])
    full, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)),
                  {0: [EngineRequest("r", prompt, params)]})
    delivered = full["r"][:7]
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256, prefill_chunk=8))
    rest, _ = run(engine, {0: [EngineRequest("r", prompt, params, generated_ids=tokens(delivered))]})
    assert tokens(rest["r"]) == tokens(full["r"])[7:]
    assert text(delivered) + text(rest["r"]) == text(full["r"])
    assert [o.completion_tokens for o in rest["r"]] == [o.completion_tokens for o in full["r"][7:]]
    assert rest["r"][-1].finish_reason == "length" and rest["r"][-1].prompt_tokens == len(prompt)


def test_continuation_primes_stop_strings_across_the_boundary(model, tokenizer):
    """A stop string whose first half was generated (and held back) before the hand-over and
    whose second half comes after it is still found, and never emitted."""
    prompt = ids(tokenizer, PROMPTS[0])
    full, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)),
                  {0: [EngineRequest("f", prompt, greedy(40))]})
    pieces = [o.text for o in full["f"]]
    cut = next(i for i in range(6, 30) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[cut][-2:] + pieces[cut + 1][:2]
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=[stop])
    whole, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)),
                   {0: [EngineRequest("w", prompt, params)]})
    assert whole["w"][-1].finish_reason == "stop"
    # hand over right after the token carrying the first half of the stop string
    delivered = whole["w"][: cut + 1]
    rest, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)),
                  {0: [EngineRequest("w", prompt, params, generated_ids=tokens(delivered))]})
    assert text(delivered) + text(rest["w"]) == text(whole["w"])
    assert stop not in text(delivered) + text(rest["w"])
    assert rest["w"][-1].finish_reason == "stop"


def test_continuation_of_a_finished_request_only_reports_its_final(model, tokenizer):
    prompt = ids(tokenizer, PROMPTS[0])
    ref = reference(model, prompt, 6)
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256))
    outs, steps = run(engine, {0: [EngineRequest("done", prompt, greedy(6), generated_ids=ref)]})
    assert [(o.finished, o.finish_reason, o.token_ids, o.completion_tokens) for o in outs["done"]] == \
        [(True, "length", [], 6)]
    assert not engine.has_work and engine.kv_tokens_used == 0


# ---- lanes: prefill budget in lane order, with aging -----------------------------------------

def _prefilled_per_step(engine, rids, steps):
    seen = []
    for _ in range(steps):
        before = {r: engine._by_rid[r].computed for r in rids if r in engine._by_rid}
        engine.step()
        seen.append({r: engine._by_rid[r].computed - c for r, c in before.items() if r in engine._by_rid})
    return seen


def test_prefill_chunks_go_to_the_interactive_lane_first(model, tokenizer):
    long_prompt = ids(tokenizer, PROMPTS[1] * 4)
    engine = Engine(model, tokenizer, EngineConfig(max_batch=3, max_seq_len=512, prefill_chunk=16,
                                                   lane_aging_steps=100))
    engine.add(EngineRequest("batch", long_prompt, greedy(2), priority="batch"))
    engine.step()
    assert engine._by_rid["batch"].computed == 16
    # a prompt of its own: an identical one would take batch's computed block from the prefix cache
    engine.add(EngineRequest("chat", ids(tokenizer, "Chat. " + PROMPTS[1] * 4), greedy(2), priority="interactive"))
    progress = _prefilled_per_step(engine, ["batch", "chat"], 3)
    assert all(p["chat"] == 16 and p["batch"] == 0 for p in progress)


def test_aging_keeps_batch_prefill_moving_under_interactive_load(model, tokenizer):
    long_prompt = ids(tokenizer, PROMPTS[1] * 6)
    engine = Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=1024, prefill_chunk=16,
                                                   lane_aging_steps=3))
    engine.add(EngineRequest("batch", long_prompt, greedy(2), priority="batch"))
    for i in range(3):   # prompts of their own: identical ones would share blocks through the prefix cache
        engine.add(EngineRequest(f"chat{i}", ids(tokenizer, f"Chat {i}. " + PROMPTS[1] * 6), greedy(2),
                                 priority="interactive"))
    progress = _prefilled_per_step(engine, ["batch"], 12)
    got = [p.get("batch", 0) for p in progress]
    assert got.count(16) >= 2, got  # served every aging_steps + 1 steps while interactive prefills
    assert all(0 in got[i : i + 3] for i in range(0, 9)), got  # ... but interactive still comes first


def test_ignore_eos_masks_eos_instead_of_emitting_it(model, tokenizer):
    """With ignore_eos the EOS id is never sampled (forced lengths stay comparable with
    generate's min_new_tokens), rather than emitted and continued past."""
    prompt = ids(tokenizer, PROMPTS[0])
    ref = reference(model, prompt, 10)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, ref[3]]
    try:
        engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256))
        with torch.inference_mode():
            forced = model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                                    pad_token_id=tokenizer.eos_token_id)[0, len(prompt):].tolist()
    finally:
        model.generation_config.eos_token_id = saved
    outs, _ = run(engine, {0: [EngineRequest("e", prompt, greedy(10), ignore_eos=True)]})
    assert ref[3] not in tokens(outs["e"]) and tokens(outs["e"]) == forced
    assert outs["e"][-1].finish_reason == "length" and outs["e"][-1].completion_tokens == 10


def test_a_reused_slot_samples_with_its_new_requests_parameters(model, tokenizer):
    """Sampling parameters live per slot and are written when a request first samples there: with
    one slot, each request in turn (greedy, seeded top-k, ignore_eos, a second seeded run with the
    same id, as a failover continuation has) must sample under its own parameters, not the
    previous holder's."""
    prompt = ids(tokenizer, PROMPTS[0])
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=77)
    alone, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=1, max_seq_len=256)),
                   {0: [EngineRequest("s", prompt, seeded)]})
    ref = reference(model, prompt, 12)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, ref[2]]   # greedy ends at its 3rd token
    try:
        engine = Engine(model, tokenizer, EngineConfig(max_batch=1, max_seq_len=256))
        outs, _ = run(engine, {0: [EngineRequest("g", prompt, greedy(12)),
                                   EngineRequest("s", prompt, seeded),
                                   EngineRequest("f", prompt, greedy(12), ignore_eos=True)]})
        assert tokens(outs["g"]) == ref[:3] and outs["g"][-1].finish_reason == "stop"
        assert tokens(outs["s"]) == tokens(alone["s"]) != ref   # sampled under its own seed
        f = tokens(outs["f"])
        assert f[:2] == ref[:2] and f[2] != ref[2] and len(f) == 12   # greedy, its EOS masked
        again, _ = run(engine, {0: [EngineRequest("s", prompt, seeded), EngineRequest("g2", prompt, greedy(2))]})
        assert tokens(again["s"]) == tokens(alone["s"]) and tokens(again["g2"]) == ref[:2]
    finally:
        model.generation_config.eos_token_id = saved


def test_decode_segments_cut_off_one_long_row():
    from worker.engine.attention import decode_segments
    assert decode_segments([10] * 15 + [500]) == [(0, 15, 10), (15, 16, 500)]
    assert decode_segments([500] + [10] * 15) == [(0, 1, 500), (1, 16, 10)]
    assert decode_segments([10, 12, 11, 9]) == [(0, 4, 12)]  # nothing worth cutting
    assert decode_segments([7]) == [(0, 1, 7)]


def test_decode_segments_take_the_cheapest_cut_when_it_saves_a_quarter():
    """Against brute force over every cut: the cost is rows x longest context per segment."""
    import random

    from worker.engine.attention import decode_segments
    rng = random.Random(0)
    for _ in range(2000):
        lengths = [rng.choice([rng.randint(1, 20), rng.randint(1, 2000)]) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.5:
            lengths.sort()
        rows, whole = len(lengths), len(lengths) * max(lengths)
        cost = lambda i: i * max(lengths[:i]) + (rows - i) * max(lengths[i:])
        best = min((cost(i) for i in range(1, rows)), default=whole)
        segments = decode_segments(lengths)
        assert [s[:2] for s in segments] == ([(0, segments[0][1]), (segments[0][1], rows)] if len(segments) == 2 else [(0, rows)])
        assert all(longest == max(lengths[a:b]) for a, b, longest in segments)
        if best <= 0.75 * whole:
            assert len(segments) == 2 and cost(segments[0][1]) == best
        else:
            assert len(segments) == 1


def test_long_request_in_a_high_slot_equals_generate(model, tokenizer):
    """Short requests in low slots decode in their own segment while a long one sits in the
    highest slot: every request still equals generate() alone."""
    engine = Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=512, prefill_chunk=64))
    short = [ids(tokenizer, p) for p in ("Hi", "Hello there", "1 2 3")]
    long_prompt = ids(tokenizer, PROMPTS[1] * 4)
    schedule = {0: [EngineRequest(f"s{i}", p, greedy(12)) for i, p in enumerate(short)]
                + [EngineRequest("long", long_prompt, greedy(12))]}
    outs, _ = run(engine, schedule)
    for i, p in enumerate(short):
        assert tokens(outs[f"s{i}"]) == reference(model, p, 12)
    assert tokens(outs["long"]) == reference(model, long_prompt, 12)
