"""vLLM's per-request sampling controls in the engine's batched path (worker.engine.penalties,
worker.engine.logit_bias, min-p in worker.engine.sampling), in-process.

Greedy + each control equals `model.generate` with transformers' logits processors on tiny
random models of several families (repetition: `RepetitionPenaltyLogitsProcessor`; logit_bias:
`SequenceBiasLogitsProcessor`; min_tokens: `MinNewTokensLengthLogitsProcessor`; presence and
frequency: OpenAI's definition, written below as a processor), every control a row of one mixed
batch beside rows that use none. A seeded run is reproducible whatever shares its batch, and a
failover continuation (prompt + delivered ids) and a preempted request's recompute yield exactly
the uninterrupted run: the counts the penalties need are rebuilt from the context.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from shared.errors import ErrorCode
from shared.sampling import SamplingParams
from tests.engine_families import FAMILIES, PROMPTS, Tok
from tests.test_engine import ids, run, text, tokens
from worker.engine import Engine, EngineConfig, EngineRejected, EngineRequest

N = 20
EOS = 2
CONTROLS = {
    "none": {},
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.8),
    "negative": dict(presence_penalty=-0.7, frequency_penalty=-0.2),
    "repetition": dict(repetition_penalty=1.6),
    "repetition<1": dict(repetition_penalty=0.6),
    "bias": dict(logit_bias={50: 3.0, 51: -100.0, 300: 1.5}),
    "all": dict(presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={77: 2.0}),
    # EOS and stop id 60 all but forced, held off for 8 tokens
    "min_tokens": dict(min_tokens=8, stop_token_ids=[60], logit_bias={EOS: 10.0, 60: 10.0}),
}


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence / frequency penalties over the generated tokens (not the prompt)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def hf_reference(model, prompt: list[int], p: SamplingParams) -> list[int]:
    """`generate`'s greedy tokens under the controls of `p`, ending at EOS or a stop id."""
    kwargs: dict = {"eos_token_id": [EOS, *p.stop_token_ids]}
    processors = LogitsProcessorList()
    if p.repetition_penalty != 1:
        kwargs["repetition_penalty"] = p.repetition_penalty
    if p.presence_penalty or p.frequency_penalty:
        processors.append(OpenAIPenalties(len(prompt), p.presence_penalty, p.frequency_penalty))
    if p.logit_bias:
        kwargs["sequence_bias"] = [[[t], b] for t, b in p.logit_bias.items()]
    if p.min_tokens:
        kwargs["min_new_tokens"] = p.min_tokens
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=p.max_tokens, do_sample=False, pad_token_id=0,
                             logits_processor=processors, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral-window"])
def test_greedy_with_each_control_equals_transformers_processors(family):
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    model.generation_config.eos_token_id = None
    engine = Engine(model, Tok(), EngineConfig(max_batch=8, max_seq_len=128, prefill_chunk=8))
    engine.eos_ids = {EOS}
    params = {(name, i): SamplingParams(max_tokens=N, temperature=0.0, **kw)
              for name, kw in CONTROLS.items() for i in range(len(PROMPTS))}
    schedule: dict[int, list] = {}
    for step, ((name, i), p) in enumerate(params.items()):   # one joins per step: mixed prefill and decode
        schedule.setdefault(step, []).append(EngineRequest(f"{name}/{i}", PROMPTS[i], p))
    outs, _ = run(engine, schedule)
    got = {key: tokens(outs[f"{key[0]}/{key[1]}"]) for key in params}
    for key, p in params.items():
        assert got[key] == hf_reference(model, PROMPTS[key[1]], p), key
    for name in CONTROLS:   # each control changed some answer: the comparison above means something
        if name != "none":
            assert any(got[(name, i)] != got[("none", i)] for i in range(len(PROMPTS))), name
    for i in range(len(PROMPTS)):
        held = got[("min_tokens", i)]
        assert not {EOS, 60} & set(held[:8]) and held[-1] in (EOS, 60) and outs[f"min_tokens/{i}"][-1].finish_reason == "stop"
    assert engine.runner.batch.penalties.num_active == engine.runner.batch.bias.num_biased == 0


SEEDED = SamplingParams(max_tokens=40, temperature=0.9, seed=5, presence_penalty=0.6, frequency_penalty=0.3,
                        repetition_penalty=1.2, logit_bias={300: 2.0, 301: -5.0}, min_p=0.05, min_tokens=10)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40, temperature=0.0, presence_penalty=0.6,
                                                   frequency_penalty=0.3, repetition_penalty=1.2,
                                                   logit_bias={300: 2.0}, min_tokens=10), SEEDED],
                         ids=["greedy", "seeded"])
def test_continuation_and_preemption_rebuild_the_counts_exactly(model, tokenizer, params):
    """A failover continuation (prompt + 13 delivered ids) and a request preempted by a full KV
    pool (which recomputes its context) both yield the uninterrupted run's tokens and text."""
    prompt = ids(tokenizer, "Once upon a time, in a land far away, there lived a dragon who loved tea.")
    full, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)),
                  {0: [EngineRequest("r", prompt, params, ignore_eos=True)]})
    delivered = full["r"][:13]
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256, prefill_chunk=8))
    rest, _ = run(engine, {0: [EngineRequest("r", prompt, params, generated_ids=tokens(delivered), ignore_eos=True)]})
    assert tokens(rest["r"]) == tokens(full["r"])[13:]
    assert text(delivered) + text(rest["r"]) == text(full["r"])
    # preemption: a greedy interactive request squeezes the batch-lane one out of a 96-token pool
    engine = Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=128, kv_cache_tokens=96))
    engine.add(EngineRequest("b", prompt, params, priority="batch", ignore_eos=True))
    engine.add(EngineRequest("i", ids(tokenizer, "Hello there, how are you doing today?"),
                             SamplingParams(max_tokens=40, temperature=0.0), ignore_eos=True))
    outs, _ = run(engine)
    assert engine.preemptions >= 1
    assert tokens(outs["b"]) == tokens(full["r"]) and text(outs["b"]) == text(full["r"])


def test_a_seeded_run_with_controls_is_reproducible_in_any_batch(model, tokenizer):
    prompt = ids(tokenizer, "Hello there, how are you doing today?")
    alone, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=256)),
                   {0: [EngineRequest("s", prompt, SEEDED, ignore_eos=True)]})
    others = [EngineRequest(f"o{i}", ids(tokenizer, f"Story number {i}:"),
                            SamplingParams(max_tokens=30, temperature=1.0, frequency_penalty=0.5 * i), ignore_eos=True)
              for i in range(3)]
    mixed, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=256, prefill_chunk=8)),
                   {0: others[:2], 3: [EngineRequest("s", prompt, SEEDED, ignore_eos=True)], 5: others[2:]})
    assert tokens(mixed["s"]) == tokens(alone["s"]) and len(tokens(alone["s"])) == 40
    unseeded = SamplingParams(**{**SEEDED.__dict__, "seed": 6})
    other_seed, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=256)),
                        {0: [EngineRequest("s", prompt, unseeded, ignore_eos=True)]})
    assert tokens(other_seed["s"]) != tokens(alone["s"])


def test_logit_bias_forces_and_forbids(model, tokenizer):
    prompt = ids(tokenizer, "Hi")
    plain, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=128)),
                   {0: [EngineRequest("p", prompt, SamplingParams(max_tokens=6, temperature=0.0))]})
    first = tokens(plain["p"])[0]
    forced = SamplingParams(max_tokens=6, temperature=1.0, logit_bias={4321: 100.0})
    forbidden = SamplingParams(max_tokens=6, temperature=0.0, logit_bias={first: -100.0})
    outs, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=128)),
                  {0: [EngineRequest("f", prompt, forced), EngineRequest("x", prompt, forbidden)]})
    assert tokens(outs["f"]) == [4321] * 6
    assert tokens(outs["x"])[0] != first


def test_stop_token_ids_include_stop_str_and_special_tokens(model, tokenizer):
    """stop_token_ids end the answer with "stop" (the token's text left out unless
    include_stop_str_in_output); include_stop_str_in_output keeps a stop string;
    skip_special_tokens=False shows special tokens' text."""
    prompt = ids(tokenizer, PROMPT)
    base = SamplingParams(max_tokens=30, temperature=0.0)
    plain, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=4, max_seq_len=256)),
                   {0: [EngineRequest("p", prompt, base)]})
    got = tokens(plain["p"])
    at = next(i for i in range(3, 30) if got[i] not in got[:i] and tokenizer.decode([got[i]]).strip())
    stop_id = got[at]
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True, clean_up_tokenization_spaces=False)  # noqa: E731
    whole = text(plain["p"])
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    reqs = {"id": dict(stop_token_ids=[stop_id]), "id+": dict(stop_token_ids=[stop_id], include_stop_str_in_output=True),
            "str+": dict(stop=[stop], include_stop_str_in_output=True),
            "special": dict(max_tokens=3, logit_bias={special: 100.0}, skip_special_tokens=False),
            "hidden": dict(max_tokens=3, logit_bias={special: 100.0})}
    outs, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=8, max_seq_len=256)),
                  {0: [EngineRequest(k, prompt, SamplingParams(**{**base.__dict__, **v})) for k, v in reqs.items()]})
    assert tokens(outs["id"]) == got[:at + 1] and outs["id"][-1].finish_reason == "stop"
    assert text(outs["id"]) == decode(got[:at]) and text(outs["id+"]) == decode(got[:at + 1])
    assert text(outs["str+"]) == whole[:whole.index(stop) + len(stop)] and outs["str+"][-1].finish_reason == "stop"
    assert text(outs["special"]) == "<|im_start|>" * 3 and text(outs["hidden"]) == ""


PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def test_min_tokens_holds_off_stop_strings_too(model, tokenizer):
    """A stop string in the text of the first min_tokens tokens does not end the answer; one
    that ends after them does, even if it began before (vLLM's rule)."""
    prompt = ids(tokenizer, PROMPT)
    plain, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)),
                   {0: [EngineRequest("p", prompt, SamplingParams(max_tokens=30, temperature=0.0))]})
    pieces = [o.text for o in plain["p"]]
    whole, floor = "".join(pieces), len("".join(pieces[:6]))
    early = next(p for p in pieces[1:5] if len(p.strip()) >= 2).strip()
    at = whole.find(early, max(0, floor - len(early) + 1))
    reqs = [EngineRequest(rid, prompt, SamplingParams(max_tokens=30, temperature=0.0, stop=[early], min_tokens=m))
            for rid, m in (("free", 0), ("held", 6))]
    outs, _ = run(Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=256)), {0: reqs})
    assert text(outs["free"]) == whole[:whole.index(early)] and outs["free"][-1].finish_reason == "stop"
    assert text(outs["held"]) == (whole[:at] if at >= 0 else whole)
    assert outs["held"][-1].finish_reason == ("stop" if at >= 0 else "length")


@pytest.mark.parametrize("bad,param", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=9), "min_tokens"), (dict(stop_token_ids=[10 ** 6]), "stop_token_ids"),
    (dict(logit_bias={10 ** 6: 1.0}), "logit_bias"), (dict(logit_bias={5: 101.0}), "logit_bias")])
def test_bad_controls_are_refused_with_their_param(model, tokenizer, bad, param):
    engine = Engine(model, tokenizer, EngineConfig(max_batch=2, max_seq_len=128))
    with pytest.raises(EngineRejected) as info:
        engine.add(EngineRequest("b", ids(tokenizer, "Hi"), SamplingParams(max_tokens=8, **bad)))
    assert info.value.code == ErrorCode.INVALID_REQUEST and info.value.param == param
    assert not engine.has_work


def test_min_tokens_forbids_each_rows_own_end_ids_until_reached():
    """Rows with different numbers of end ids in one step (the table widens as a row needs more):
    each forbids its own (EOS and its stop_token_ids), nothing else, and only until it has
    produced min_tokens (a continuation's delivered tokens count)."""
    from worker.engine.logit_bias import LogitBias
    bias = LogitBias(4, torch.device("cpu"), lambda: {EOS})
    bias.add(0, SamplingParams(max_tokens=9, min_tokens=2), 0)
    bias.add(1, SamplingParams(max_tokens=9, min_tokens=3, stop_token_ids=[7, 8, 9]), 1)
    bias.add(2, SamplingParams(max_tokens=9, min_tokens=2), 2)          # already there: nothing held
    slots = np.array([0, 1, 2])
    forbidden = []
    for _ in range(3):
        logits = torch.zeros(3, 12)
        bias.apply(logits, slots)
        forbidden.append([torch.isinf(row).nonzero()[:, 0].tolist() for row in logits])
        bias.advance(slots)
    assert forbidden == [[[EOS], [EOS, 7, 8, 9], []], [[EOS], [EOS, 7, 8, 9], []], [[], [], []]]
    assert bias.num_min == 0
