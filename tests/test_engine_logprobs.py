"""Logprobs in the engine (worker.engine.logprobs) on a tiny random Llama with SmolLM2's real
tokenizer: each token's logprob and its top-k equal a log-softmax of the model's raw logits
computed independently (transformers' own forward over the whole context), whatever the
request was sampled with; the greedy token is the top one; top-k is sorted; rows that do not ask
get none and sample exactly as without logprobs in the batch; a continuation (failover) gets the
same entries, text offsets included; the count of asking rows returns to zero."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.sampling import SamplingParams
from worker.engine import Engine, EngineConfig, EngineRejected, EngineRequest
from worker.engine.input_batch import InputBatch
from worker.engine.logprobs import LogprobGather
from worker.engine.sequence import Sequence

PROMPTS = ["Hello there, how are you doing today?", "The quick brown fox jumps over the lazy dog.", "Hi",
           "Once upon a time, in a land far away"]
TOL = 2e-4      # the engine's decoder vs transformers' forward: same math, another order of sums


def run(engine, requests):
    outs: dict[str, list] = {}
    for req in requests:
        engine.add(req)
    while engine.has_work:
        for o in engine.step():
            outs.setdefault(o.rid, []).append(o)
    return outs


def tokens(outs):
    return [t for o in outs for t in o.token_ids]


def entries(outs):
    return [e for o in outs for e in (o.logprobs or [])]


def reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each output position [len(output), vocab]."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(output)].log_softmax(-1)


def check_against_reference(model, tokenizer, prompt, outs, k):
    out_ids = tokens(outs)
    got = entries(outs)
    assert len(got) == len(out_ids)
    ref = reference(model, prompt, out_ids)
    offset = 0
    for pos, (token, (text, logprob, top, text_offset)) in enumerate(zip(out_ids, got)):
        assert text == tokenizer.decode([token], skip_special_tokens=False)
        assert abs(logprob - ref[pos, token].item()) < TOL, pos
        assert text_offset == offset
        offset += len(text)
        assert len(top) == k
        lps = [lp for _, lp in top]
        assert lps == sorted(lps, reverse=True)
        vals, ids = ref[pos].topk(k)
        assert [t for t, _ in top] == [tokenizer.decode([i], skip_special_tokens=False) for i in ids.tolist()]
        assert all(abs(a - b) < TOL for a, b in zip(lps, vals.tolist()))


def test_greedy_logprobs_equal_a_reference_log_softmax_and_the_token_is_top_1(model, tokenizer):
    prompt = tokenizer(PROMPTS[0])["input_ids"]
    engine = Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=256, prefill_chunk=8))
    outs = run(engine, [EngineRequest("g", prompt, SamplingParams(max_tokens=16, temperature=0.0, logprobs=5))])["g"]
    check_against_reference(model, tokenizer, prompt, outs, 5)
    for text, logprob, top, _ in entries(outs):
        assert top[0][0] == text and top[0][1] == logprob      # greedy: the sampled token is the top one
    assert engine.runner.batch.num_logprobs == 0


def test_sampled_rows_get_the_raw_models_logprobs_not_the_tempered_ones(model, tokenizer):
    """Temperature, top-k and top-p change what is drawn, not the logprobs reported (vLLM's
    raw_logprobs): they equal the untempered log-softmax."""
    prompt = tokenizer(PROMPTS[3])["input_ids"]
    engine = Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=256))
    params = SamplingParams(max_tokens=12, temperature=1.7, top_k=30, top_p=0.9, seed=5, logprobs=3)
    outs = run(engine, [EngineRequest("s", prompt, params)])["s"]
    check_against_reference(model, tokenizer, prompt, outs, 3)


def test_a_mixed_batch_only_the_asking_rows_get_logprobs_and_sampling_is_unchanged(model, tokenizer):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    asks = [None, 0, None, 20]

    def requests(with_logprobs: bool):
        return [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=10, temperature=0.8 if i % 2 else 0.0, seed=i,
                                                         logprobs=asks[i] if with_logprobs else None))
                for i, p in enumerate(prompts)]

    config = EngineConfig(max_batch=4, max_seq_len=256, prefill_chunk=64)
    plain = run(Engine(model, tokenizer, config), requests(False))
    engine = Engine(model, tokenizer, config)
    mixed = run(engine, requests(True))
    for i, k in enumerate(asks):
        rid = f"r{i}"
        assert tokens(mixed[rid]) == tokens(plain[rid])
        assert "".join(o.text for o in mixed[rid]) == "".join(o.text for o in plain[rid])
        if k is None:
            assert all(o.logprobs is None for o in mixed[rid])
        else:
            check_against_reference(model, tokenizer, prompts[i], mixed[rid], k)
    assert engine.runner.batch.num_logprobs == 0


def test_a_continuation_gets_the_same_entries_and_offsets(model, tokenizer):
    prompt = tokenizer(PROMPTS[1])["input_ids"]
    params = SamplingParams(max_tokens=14, temperature=0.0, logprobs=2)
    full = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)),
               [EngineRequest("c", prompt, params)])["c"]
    rest = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256, prefill_chunk=8)),
               [EngineRequest("c", prompt, params, generated_ids=tokens(full[:6]))])["c"]
    want, got = entries(full)[6:], entries(rest)
    assert [(e[0], e[3], [t for t, _ in e[2]]) for e in got] == [(e[0], e[3], [t for t, _ in e[2]]) for e in want]
    assert all(abs(a[1] - b[1]) < TOL for a, b in zip(got, want))


def test_the_asking_count_returns_to_zero_on_cancel_and_refusal(model, tokenizer):
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=64))
    prompt = tokenizer(PROMPTS[0])["input_ids"]
    engine.add(EngineRequest("a", prompt, SamplingParams(max_tokens=8, logprobs=1)))
    engine.step()                     # admitted: its row asks
    assert engine.runner.batch.num_logprobs == 1
    engine.cancel("a")
    engine.step()
    assert engine.runner.batch.num_logprobs == 0
    with pytest.raises(EngineRejected):
        engine.add(EngineRequest("b", prompt, SamplingParams(max_tokens=8, logprobs=21)))
    with pytest.raises(EngineRejected):   # never fits: refused before it is counted
        engine.add(EngineRequest("c", prompt, SamplingParams(max_tokens=500, logprobs=1)))
    assert engine.runner.batch.num_logprobs == 0


def test_gather_does_nothing_while_no_request_asks():
    """The runner skips the gather while its batch holds no row that asks (`num_logprobs`, one
    integer test), and a step whose sampled rows do not ask gets nothing from it either."""
    batch = InputBatch(4, torch.device("cpu"))

    def seq(logprobs):
        req = EngineRequest(f"r{logprobs}", [1, 2], SamplingParams(logprobs=logprobs))
        return Sequence(req=req, detok=None, generator=None, arrival=0, tokens=[1, 2])
    plain, asking = seq(None), seq(2)
    batch.add(plain)
    assert batch.num_logprobs == 0
    batch.add(asking)
    assert batch.num_logprobs == 1 and batch.top_logprobs[[plain.slot, asking.slot]].tolist() == [-1, 2]
    row = asking.slot
    batch.remove(asking)
    assert batch.num_logprobs == 0 and batch.top_logprobs[row] == -1 and asking.slot == -1
    assert LogprobGather.prepare(torch.zeros(3, 10), np.full(3, -1)) is None


def test_gather_brings_tokens_and_each_rows_top_k_in_one_transfer():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))

    gather = LogprobGather()
    pending = gather.prepare(logits, np.array([-1, 2, -1, 0, 4]))
    tokens = torch.tensor([7, 3, 9, 11, 40])
    ids, rows = gather.finish(pending, tokens)
    assert ids == tokens.tolist() and rows[0] is None and rows[2] is None
    ref = logits.log_softmax(-1)
    for r, k in ((1, 2), (3, 0), (4, 4)):
        logprob, top_ids, top_lps = rows[r]
        assert abs(logprob - ref[r, tokens[r]].item()) < 1e-6
        assert top_ids == ref[r].topk(k).indices.tolist() if k else top_ids == []
        assert len(top_lps) == k


def test_outputs_carry_logprobs_through_the_engine_pipe_and_into_token_events():
    """engine process -> worker (keyed msgpack columns) -> a token event's `lp`, one entry per id."""
    import msgpack

    from shared.events import TokEvent
    from shared.streams import RequestEntry, decode_event
    from worker.engine import StepOutput
    from worker.engine_wire import pack_outputs, unpack_outputs
    from worker.events import InFlight, Progress

    lp = [["Hi", -0.5, [["Hi", -0.5], [" there", -1.25]], 0]]
    outs = [StepOutput("r", "Hi", [5], False, None, 3, 1, logprobs=lp),
            StepOutput("r", "!", [6], True, "stop", 3, 2, logprobs=[["!", -2.0, [], 2]]),
            StepOutput("q", "x", [7], False, None, 3, 1)]
    back = unpack_outputs(msgpack.unpackb(msgpack.packb(pack_outputs(outs))))
    assert back == outs
    assert [msgpack.unpackb(msgpack.packb(b.logprobs)) if b.logprobs else None for b in back] == \
        [lp, [["!", -2.0, [], 2]], None]
    assert back[1].finished and back[1].finish_reason == "stop" and back[2].logprobs is None
    entry = RequestEntry(rid="r", params=SamplingParams(logprobs=1), prompt="p")
    st = InFlight.start("r", "1-0", entry, Progress())
    for b in back[:2]:
        st.add_output(b)
    tok = decode_event(st.unsent[0].payload)
    assert tok["ids"] == [5, 6] and tok["lp"] == lp + [["!", -2.0, [], 2]]
    assert "lp" not in decode_event(TokEvent("q", 1, [7], "x", 1, 0).encode())


def test_request_entries_carry_logprobs_only_when_asked():
    from shared.streams import RequestEntry
    import msgpack
    plain = RequestEntry(rid="r", params=SamplingParams(), prompt="p").encode()
    assert "logprobs" not in msgpack.unpackb(plain)["params"]     # what older workers can read
    asked = RequestEntry.decode(RequestEntry(rid="r", params=SamplingParams(logprobs=4), prompt="p").encode())
    assert asked.params.logprobs == 4
    bad = msgpack.unpackb(plain)
    bad["params"]["logprobs"] = 21
    with pytest.raises(ValueError):
        RequestEntry.decode(msgpack.packb(bad))
