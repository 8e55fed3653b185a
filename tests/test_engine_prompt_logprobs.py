"""Prompt logprobs and echo in the engine (completions `echo` + `logprobs`, vLLM's
`prompt_logprobs`) on a tiny random Llama with SmolLM2's real tokenizer: computed during chunked
prefill in the batched step, only for the rows that ask; each prompt token's logprob and top-k
equal a log-softmax of transformers' own forward over the prompt; the first token has none;
the prefix cache never skips a position of a request that asks (and still serves the others);
a continuation (failover) sends no prompt again; the first output carries them across the
engine pipe into the token event (`pr`), and a resume's `tail` of that event drops them."""

from __future__ import annotations

import msgpack
import torch

from shared.events import TokEvent, decode_event
from shared.sampling import SamplingParams
from shared.streams import RequestEntry
from worker.engine import Engine, EngineConfig, EngineRequest, StepOutput
from worker.engine_wire import pack_outputs, unpack_outputs
from worker.events import InFlight, Progress
from tests.test_engine_logprobs import TOL, run, tokens

PROMPT = "Once upon a time, in a land far away, there lived a lighthouse keeper who"


def prompt_reference(model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every prompt position but the last [len - 1, vocab]."""
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def first_prompt(outs) -> list:
    with_prompt = [o.prompt for o in outs if o.prompt is not None]
    assert len(with_prompt) == 1 and outs[0].prompt is not None, "the first output alone carries it"
    return with_prompt[0]


def check_prompt_entries(model, tokenizer, ids, entries, k):
    words = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert [e[0] for e in entries] == words
    assert entries[0][1] is None and entries[0][2] == [] and entries[0][3] == 0
    assert [e[3] for e in entries] == [sum(len(w) for w in words[:i]) for i in range(len(words))]
    ref = prompt_reference(model, ids)
    for pos, (token, (_, logprob, top, _)) in enumerate(zip(ids[1:], entries[1:])):
        assert abs(logprob - ref[pos, token].item()) < TOL, pos
        vals, top_ids = ref[pos].topk(k)
        assert [t for t, _ in top] == [tokenizer.decode([i], skip_special_tokens=False) for i in top_ids.tolist()]
        assert all(abs(a - b) < TOL for (_, a), b in zip(top, vals.tolist()))


def test_prompt_logprobs_over_chunked_prefill_equal_a_reference_and_echo_gives_the_text(model, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    assert len(ids) > 16      # three prefill chunks of 8
    engine = Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=256, prefill_chunk=8))
    outs = run(engine, [EngineRequest("e", ids, SamplingParams(max_tokens=3, temperature=0.0, logprobs=1,
                                                              prompt_logprobs=3, echo=True),
                                      prompt_text=PROMPT)])["e"]
    text, entries = first_prompt(outs)
    assert text == PROMPT and len(entries) == len(ids)
    check_prompt_entries(model, tokenizer, ids, entries, 3)
    # with echo, the output's text offsets go on after the prompt's tokens (vLLM's)
    prompt_chars = sum(len(e[0]) for e in entries)
    assert outs[0].logprobs[0][3] == prompt_chars
    # echo alone: the text, no logprobs; the prompt decoded when no text came with it
    alone = run(engine, [EngineRequest("t", ids, SamplingParams(max_tokens=2, temperature=0.0, echo=True))])["t"]
    assert first_prompt(alone) == [tokenizer.decode(ids), None]
    assert tokens(alone) == tokens(outs)[:2]


def test_only_the_asking_rows_pay_and_the_others_sample_as_alone(model, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    other = tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
    engine = Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=256, prefill_chunk=64,
                                                   prefix_caching=False))
    alone = tokens(run(engine, [EngineRequest("a", other, SamplingParams(max_tokens=6, temperature=0.0))])["a"])
    outs = run(engine, [EngineRequest("p", ids, SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=0)),
                        EngineRequest("a", other, SamplingParams(max_tokens=6, temperature=0.0))])
    assert tokens(outs["a"]) == alone and all(o.prompt is None for o in outs["a"])
    _, entries = first_prompt(outs["p"])
    check_prompt_entries(model, tokenizer, ids, entries, 0)


def test_the_prefix_cache_never_skips_a_position_of_a_request_that_asks(model, tokenizer):
    ids = tokenizer(PROMPT * 2)["input_ids"]
    engine = Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=512, prefill_chunk=16))
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    first = run(engine, [EngineRequest("c1", ids, greedy)])["c1"]
    asks = run(engine, [EngineRequest("c2", ids, SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1))])
    _, entries = first_prompt(asks["c2"])
    assert asks["c2"][-1].cached_tokens == 0 and len(entries) == len(ids)
    check_prompt_entries(model, tokenizer, ids, entries, 1)
    assert tokens(asks["c2"]) == tokens(first)
    again = run(engine, [EngineRequest("c3", ids, greedy)])["c3"]      # the cache still serves the others
    assert again[-1].cached_tokens > 0 and tokens(again) == tokens(first)


def test_a_continuation_sends_no_prompt_again(model, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    engine = Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=256, prefill_chunk=8))
    params = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2, echo=True)
    whole = run(engine, [EngineRequest("w", ids, params)])["w"]
    done = tokens(whole)
    rest = run(engine, [EngineRequest("w", ids, params, generated_ids=done[:2])])["w"]
    assert tokens(rest) == done[2:] and all(o.prompt is None for o in rest)


def test_the_prompt_crosses_the_engine_pipe_into_the_first_token_event_and_a_tail_drops_it():
    prompt = ["Hi there", [["Hi", None, [], 0], [" there", -1.5, [[" there", -1.5]], 2]]]
    outs = [StepOutput("r", "!", [5], False, None, 2, 1, prompt=prompt), StepOutput("r", "?", [6], False, None, 2, 2)]
    back = unpack_outputs(msgpack.unpackb(msgpack.packb(pack_outputs(outs))))
    assert back == outs and back[1].prompt is None
    entry = RequestEntry(rid="r", params=SamplingParams(prompt_logprobs=1, echo=True), prompt="Hi there")
    assert RequestEntry.decode(entry.encode()).params.prompt_logprobs == 1
    assert "echo" not in msgpack.unpackb(RequestEntry(rid="r", params=SamplingParams(), prompt="p").encode())["params"]
    st = InFlight.start("r", "1-0", entry, Progress())
    for b in back:
        st.add_output(b)
    st.freeze()
    wire = decode_event(st.unsent[0].payload)
    assert wire.prompt == prompt and wire.ids == [5, 6]
    assert wire.tail(1).prompt is None and wire.tail(1).ids == [6]
    assert "pr" not in msgpack.unpackb(TokEvent("q", 1, [7], "x", 1, 0).encode())
