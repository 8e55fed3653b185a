"""Tiny random models of every family the engine accepts, and the loop that runs prompts through
the engine the way the family tests check it (requests joining one per step, prompts in chunks
of 8, so steps mix prompt chunks with decode rows), and the prefix-caching scenario
(`assert_prefix_caching_exact`). Shared by `test_engine_families.py` and
`test_engine_prefix_cache.py` (CPU attention) and `paged_attention_checks.py` (the CUDA kernel,
graphs on and off)."""

from __future__ import annotations

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from shared.sampling import SamplingParams
from worker.engine import Engine, EngineConfig, EngineRequest

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)


class Tok:
    """Just enough tokenizer for the engine's detokenizer (text is not what these tests check)."""
    eos_token_id = 2

    def decode(self, ids, **_):
        return " ".join(str(i) for i in ids)


FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "llama-linear-rope": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama3-rope": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "qwen2-window": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8,
                                                         max_window_layers=1)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
    "mistral-window": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=8)),
}

PROMPTS = [[1, 17, 99, 3, 250, 41, 7, 300, 12, 5, 77, 401, 9, 66, 123, 8, 4, 200, 33, 11, 90],
           [1, 5], [1, 400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410]]


def reference(model, prompt, n):
    """`generate`'s greedy continuation of `prompt`, `n` tokens, EOS ignored."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def engine_tokens(model, prompts, n: int, *, max_batch: int, tokenizer=None, **config):
    """Greedy tokens of each prompt (request ids r0, r1, ...) through an engine built with
    `max_batch`, max_seq_len 128, prefill_chunk 8 and `config`; one request joins per step, every
    one runs to `n` tokens (EOS ignored). Returns (tokens by request id, the engine)."""
    engine = Engine(model, tokenizer or Tok(), EngineConfig(max_batch=max_batch, max_seq_len=128, prefill_chunk=8,
                                                            **config))
    engine.eos_ids = set()
    outs: dict[str, list[int]] = {}
    step = 0
    while step < len(prompts) or engine.has_work:
        if step < len(prompts):
            engine.add(EngineRequest(f"r{step}", prompts[step], SamplingParams(max_tokens=n, temperature=0.0)))
        for o in engine.step():
            assert o.finish_reason in (None, "length"), o
            outs.setdefault(o.rid, []).extend(o.token_ids)
        step += 1
    return outs, engine


def assert_engine_equals_generate(model, n: int, label: str) -> None:
    """Each of PROMPTS through the engine (`engine_tokens`, 2 rows) gives generate()'s greedy
    tokens alone (EOS ignored in both)."""
    refs = [reference(model, p, n) for p in PROMPTS]
    model.generation_config.eos_token_id = None
    outs, _ = engine_tokens(model, PROMPTS, n, max_batch=2)
    for i, ref in enumerate(refs):
        assert outs[f"r{i}"] == ref, f"{label} r{i}"


# ---- prefix caching: requests sharing 0, 1, many and all-but-one blocks, interleaved ---------

BASE = [1] + [(37 * i) % 480 + 20 for i in range(1, 40)]   # 40 tokens: 10 blocks of 4
PREFIX_PROMPTS = {
    "r0": BASE,
    "none": [3] + BASE[1:30],              # shares no block (its first token differs)
    "one": BASE[:4] + [200, 201, 202],     # shares 1 block
    "many": BASE[:24] + [300, 301],        # shares 6
    "but-one": BASE[:38],                  # shares every full block (9); its partial last one is its own
    "same": BASE,                          # all 10 cached: the last token's block is recomputed
    "long": BASE + [400 + i for i in range(16)],
    "cut": BASE[:32] + [450 + i for i in range(24)],   # cancelled in the middle of its prefill
    "after-cut": BASE[:32] + [450 + i for i in range(16)] + [7, 7],   # shares what "cut" had computed
}
# request -> step it joins at (requests arrive while others prefill and decode; "cont" is a
# failover continuation of r0, which has finished by then: its context hits r0's generated blocks)
PREFIX_ARRIVALS = {"r0": 0, "cut": 1, "after-cut": 2, "none": 3, "one": 4, "many": 5, "long": 6, "but-one": 7,
                   "same": 8, "cont": 40}
PREFIX_CANCEL = ("cut", 7)
PREFIX_DELIVERED = 6   # of r0's tokens, the continuation's generated_ids
# prompt tokens each request takes from the cache on that schedule with a roomy pool ("cut" and
# "after-cut" take what r0, then "cut", computed while they waited a step behind it; "long" all of
# r0's prompt; "cont" its whole prompt, and 4 of r0's generated tokens beyond it)
PREFIX_CACHED = {"r0": 0, "cut": 32, "after-cut": 48, "none": 0, "one": 4, "many": 24, "long": 40, "but-one": 36,
                 "same": 36, "cont": 40}


def prefix_references(model, n: int) -> dict[str, list[int]]:
    """generate()'s greedy tokens for each of PREFIX_PROMPTS alone (and the continuation's rest)."""
    refs = {rid: reference(model, p, n) for rid, p in PREFIX_PROMPTS.items() if rid != PREFIX_CANCEL[0]}
    refs["cont"] = refs["r0"][PREFIX_DELIVERED:]
    return refs


def prefix_engine_tokens(model, refs, n: int, **config):
    """PREFIX_PROMPTS through an engine (block size 4, prompt chunks of 8, 4 rows, max_seq_len
    128 unless `config` says otherwise) on the PREFIX_ARRIVALS schedule, "cut" cancelled at its
    step. Returns ({rid: tokens}, {rid: final output}, engine)."""
    config = {"max_batch": 4, "max_seq_len": 128, "prefill_chunk": 8, "kv_block_size": 4, **config}
    engine = Engine(model, Tok(), EngineConfig(**config))
    engine.eos_ids = set()
    requests = {rid: EngineRequest(rid, p, SamplingParams(max_tokens=n, temperature=0.0))
                for rid, p in PREFIX_PROMPTS.items()}
    requests["cont"] = EngineRequest("cont", PREFIX_PROMPTS["r0"], SamplingParams(max_tokens=n, temperature=0.0),
                                     generated_ids=refs["r0"][:PREFIX_DELIVERED])
    arrivals: dict[int, list[str]] = {}
    for rid, step in PREFIX_ARRIVALS.items():
        arrivals.setdefault(step, []).append(rid)
    tokens: dict[str, list[int]] = {}
    finals = {}
    step = 0
    while arrivals or engine.has_work:
        for rid in arrivals.pop(step, []):
            engine.add(requests[rid])
        if step == PREFIX_CANCEL[1]:
            assert PREFIX_CANCEL[0] in engine.request_ids()
            engine.cancel(PREFIX_CANCEL[0])
        for o in engine.step():
            tokens.setdefault(o.rid, []).extend(o.token_ids)
            if o.finished:
                assert o.rid not in finals
                finals[o.rid] = o
        engine.cache.pool.check()
        step += 1
        assert step < 2000
    return tokens, finals, engine


def assert_prefix_caching_exact(model, n: int, label: str, **config) -> None:
    """Caching on (a roomy pool, then one small enough to preempt) and off: each request's greedy
    tokens are generate()'s alone, the cancelled request ends cancelled, and caching really hit."""
    refs = prefix_references(model, n)
    model.generation_config.eos_token_id = None
    hits = {}
    for caching, pool in ((True, 0), (True, 96), (False, 0)):
        tokens, finals, engine = prefix_engine_tokens(model, refs, n, prefix_caching=caching, kv_cache_tokens=pool,
                                                      **config)
        for rid, ref in refs.items():
            assert tokens.get(rid) == ref, (label, caching, pool, rid, tokens.get(rid), ref)
            assert finals[rid].finish_reason == "length"
        assert finals[PREFIX_CANCEL[0]].finish_reason == "cancelled"
        assert engine.kv_tokens_used == 0 and engine.cache.num_free == engine.cache.num_blocks
        assert (engine.preemptions > 0) == (pool > 0), (label, caching, pool, engine.preemptions)
        hits[(caching, pool)] = engine.prefix_cache_hits
        reported = {rid: f.cached_tokens for rid, f in finals.items()}
        if caching and not pool:
            assert reported == PREFIX_CACHED and engine.prefix_cache_hits == sum(PREFIX_CACHED.values()) + 4, reported
        assert sum(reported.values()) <= engine.prefix_cache_hits
    assert hits[(False, 0)] == 0 and hits[(True, 96)] > 0, hits
