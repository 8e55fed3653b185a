"""Structured output in the engine (worker.engine.grammar): every output of a constrained request
parses and validates against its schema, through chunked prefill, preemption and a failover
continuation, on tiny random models of several families (SmolLM2's real tokenizer) and on the
real SmolLM2 (`slow`); unconstrained rows in the same batch are untouched."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from transformers import (AutoTokenizer, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from shared.errors import ErrorCode
from shared.sampling import SamplingParams
from worker.engine import Engine, EngineConfig, EngineRequest

# Strings, arrays and numbers are bounded: a random model must still end each document.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"]}},
    "required": ["name", "age", "address"]}
ENUMS = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "ok": {"type": "boolean"},
    "size": {"type": "string", "enum": ["S", "M", "L"]}},
    "required": ["color", "ok", "size"]}
ARRAYS = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
    "points": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "label": {"enum": ["a", "b"]}},
        "required": ["x", "label"]}}},
    "required": ["tags", "points"]}
SCHEMAS = {"person": PERSON, "enums": ENUMS, "arrays": ARRAYS}


def spec(schema: dict) -> dict:
    return {"type": "json_schema", "schema": schema}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = LlamaForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    return model, tok


def run(engine: Engine, requests: list[EngineRequest]) -> dict:
    """Requests join one per step; returns {rid: (text, token ids, final output)}."""
    out: dict[str, tuple[str, list[int], object]] = {}
    step = 0
    while step < len(requests) or engine.has_work:
        if step < len(requests):
            engine.add(requests[step])
        for o in engine.step():
            text, ids, _ = out.get(o.rid, ("", [], None))
            out[o.rid] = (text + o.text, ids + o.token_ids, o if o.finished else None)
        step += 1
    return out


def make_engine(model, tok, **config) -> Engine:
    return Engine(model, tok, EngineConfig(**{"max_batch": 8, "max_seq_len": 512, "prefill_chunk": 8, **config}))


def prompt(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_every_output_validates_against_its_schema(tiny):
    model, tok = tiny
    engine = make_engine(model, tok)
    reqs, want = [], {}
    for name, schema in SCHEMAS.items():
        for seed in (None, 1, 2):
            rid = f"{name}-{seed}"
            params = SamplingParams(max_tokens=300, temperature=0.0 if seed is None else 1.0, seed=seed,
                                    grammar=spec(schema))
            reqs.append(EngineRequest(rid, prompt(tok, f"Give me {name} as JSON, please. " * 3), params))
            want[rid] = schema
    out = run(engine, reqs)
    for rid, schema in want.items():
        text, _, final = out[rid]
        assert final.finish_reason == "stop", (rid, text)
        assert_valid(text, schema)


def test_json_object_mode_emits_an_object(tiny):
    """Any object: a random model need not end one, so a document cut by max_tokens is only
    checked to be a prefix of an object; a finished one parses."""
    model, tok = tiny
    out = run(make_engine(model, tok), [EngineRequest(f"o{s}", prompt(tok, "JSON:"), SamplingParams(
        max_tokens=40, temperature=1.0, seed=s, grammar={"type": "json_object"})) for s in range(4)])
    for text, _, final in out.values():
        assert text.startswith("{")
        if final.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_constraints_fall_only_on_constrained_rows(tiny):
    """Free rows sharing a batch with constrained ones produce what they produce alone."""
    model, tok = tiny
    free = [EngineRequest(f"free{i}", prompt(tok, f"Tell me a story {i}"), SamplingParams(max_tokens=20, temperature=0.0))
            for i in range(3)]
    alone = run(make_engine(model, tok), free)
    free = [EngineRequest(r.rid, r.prompt_ids, r.params) for r in free]
    mixed = [free[0], EngineRequest("c0", prompt(tok, "x"), SamplingParams(max_tokens=200, temperature=0.0,
                                                                           grammar=spec(ENUMS))),
             free[1], EngineRequest("c1", prompt(tok, "y"), SamplingParams(max_tokens=200, temperature=0.0,
                                                                           grammar=spec(PERSON))), free[2]]
    out = run(make_engine(model, tok), mixed)
    for r in free:
        assert out[r.rid][1] == alone[r.rid][1]
    assert_valid(out["c0"][0], ENUMS)
    assert_valid(out["c1"][0], PERSON)
    # and the same constrained request alone gives the same document (greedy)
    assert run(make_engine(model, tok), [EngineRequest("c0", prompt(tok, "x"), SamplingParams(
        max_tokens=200, temperature=0.0, grammar=spec(ENUMS)))])["c0"][0] == out["c0"][0]


def test_grammar_survives_chunked_prefill_and_preemption(tiny):
    """A pool too small for every request at once preempts (recompute) while the documents are
    being written; long prompts go in chunks of 8. Greedy: the same documents as a roomy engine."""
    model, tok = tiny
    def requests():
        return [EngineRequest(f"p{i}", prompt(tok, f"Record number {i}: " + "data " * (10 + 5 * i)),
                              SamplingParams(max_tokens=100, temperature=0.0, grammar=spec(SCHEMAS[name])))
                for i, name in enumerate(["person", "arrays", "enums", "person", "arrays", "enums"])]
    roomy = run(make_engine(model, tok), requests())
    tight_engine = make_engine(model, tok, kv_cache_tokens=200, kv_block_size=4)
    tight = run(tight_engine, requests())
    assert tight_engine.preemptions > 0
    for rid, (text, ids, final) in roomy.items():
        assert tight[rid][1] == ids
        assert final.finish_reason == "stop"
        assert_valid(text, SCHEMAS[["person", "arrays", "enums"][int(rid[1:]) % 3]])


@pytest.mark.parametrize("delivered", [1, 7, 15])
def test_failover_continuation_replays_delivered_tokens(tiny, delivered):
    """Another worker continues with prompt + the delivered ids: its matcher is rebuilt by
    replaying them, and the whole document is the one a single run writes."""
    model, tok = tiny
    p = prompt(tok, "A person, as JSON:")
    for seed in (None, 5):
        params = SamplingParams(max_tokens=200, temperature=0.0 if seed is None else 1.0, seed=seed,
                                grammar=spec(PERSON))
        text, ids, _ = run(make_engine(model, tok), [EngineRequest("a", p, params)])["a"]
        assert len(ids) > delivered
        rest = run(make_engine(model, tok), [EngineRequest("a", p, params, generated_ids=ids[:delivered])])["a"]
        assert ids[:delivered] + rest[1] == ids
        assert rest[2].finish_reason == "stop"
        assert_valid(tok.decode(ids[:delivered]) + rest[0], PERSON)


def test_a_continuation_of_a_finished_document_ends_at_once(tiny):
    model, tok = tiny
    params = SamplingParams(max_tokens=200, temperature=0.0, grammar=spec(ENUMS))
    _, ids, _ = run(make_engine(model, tok), [EngineRequest("a", prompt(tok, "z"), params)])["a"]
    engine = make_engine(model, tok)
    engine.add(EngineRequest("a", prompt(tok, "z"), params, generated_ids=ids))
    (final,) = engine.step()
    assert final.finished and final.finish_reason == "stop" and final.completion_tokens == len(ids)


def refusal(engine: Engine, req: EngineRequest):
    """The final a request with a grammar the engine refuses ends with (added, then stepped:
    the refusal comes from the compile, off the engine thread)."""
    engine.add(req)
    (final,) = engine.step()
    assert final.rid == req.rid and final.finished and final.finish_reason == "error" and not final.token_ids
    assert final.prompt_tokens == len(req.prompt_ids) and not engine.has_work
    return final


@pytest.mark.parametrize("bad", [{"type": "nonsense"}, {"type": "object", "properties": {"a": {"$ref": "#/nope"}}},
                                 {"type": "string", "pattern": "(("}])
def test_a_bad_schema_is_refused(tiny, bad):
    model, tok = tiny
    final = refusal(make_engine(model, tok), EngineRequest("b", prompt(tok, "x"), SamplingParams(grammar=spec(bad))))
    assert final.error_code == ErrorCode.INVALID_REQUEST and final.error_message.startswith("response_format:")
    assert final.error_param == "response_format"


def family_models(vocab: int):
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {"qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**common)),
            "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16)),
            "mistral-window": lambda: MistralForCausalLM(MistralConfig(**common, sliding_window=8))}


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral-window"])
def test_families(tiny, family):
    _, tok = tiny
    torch.manual_seed(0)
    model = family_models(len(tok))[family]().eval()
    reqs = [EngineRequest(f"{name}-{s}", prompt(tok, f"{name}?"), SamplingParams(
        max_tokens=300, temperature=1.0, seed=s, grammar=spec(schema))) for name, schema in SCHEMAS.items() for s in (0, 1)]
    out = run(make_engine(model, tok), reqs)
    for rid, (text, _, final) in out.items():
        assert final.finish_reason == "stop", (rid, text)
        assert_valid(text, SCHEMAS[rid.split("-")[0]])


@pytest.mark.slow
def test_smollm2_writes_valid_json():
    from shared.config import Settings
    from worker.engine import build_prompt_ids, load_model
    model, tok = load_model(Settings(model_path="", device="cpu", dtype="float32"))
    engine = Engine(model, tok, EngineConfig(max_batch=8, max_seq_len=1024, prefill_chunk=64))
    ask = {"person": "Describe a fictional person living in Paris as JSON.",
           "enums": "Pick a color, a size and whether it is ok, as JSON.",
           "arrays": "Give a few tags and points as JSON.",
           "object": "Reply with a JSON object with the keys \"city\" and \"country\" for Paris."}
    reqs = []
    for name, question in ask.items():
        ids = build_prompt_ids(tok, None, [{"role": "user", "content": question}])
        grammar = {"type": "json_object"} if name == "object" else spec(SCHEMAS[name])
        reqs.append(EngineRequest(name, ids, SamplingParams(max_tokens=400, temperature=0.0, grammar=grammar)))
    out = run(engine, reqs)
    for name, (text, _, final) in out.items():
        assert final.finish_reason == "stop", (name, text)
        assert_valid(text, SCHEMAS.get(name, {"type": "object"}))


def test_no_raw_control_characters_in_json_strings(tiny):
    """xgrammar's JSON string rule lets raw control characters through (a seeded random model
    wrote \\x01 into a string, which no JSON parser accepts): tokens holding one are masked."""
    model, tok = tiny
    engine = make_engine(model, tok)
    matcher = engine.grammars.matcher(spec({"type": "object", "properties": {"s": {"type": "string"}}}))
    for t in prompt(tok, '{"s": "ab'):
        assert matcher.accept(t)

    logits = torch.zeros(1, engine._logits_width)
    engine.grammars.apply_masks(logits, np.array([0]), [matcher])
    control = [i for i in range(len(tok)) if any(ord(c) < 0x20 for c in tok.decode([i]))]
    assert control and bool((logits[0, control] == float("-inf")).all())
    assert (logits[0] == 0).sum() > 10000      # the rest of a string's vocabulary stays allowed


def test_the_constrained_count_returns_to_zero(tiny):
    """The runner's batch counts its constrained rows (a step without any skips the masks): the
    count follows requests in and out, finished, cancelled or refused."""
    model, tok = tiny
    engine = make_engine(model, tok)
    constrained = lambda: engine.runner.batch.num_constrained   # noqa: E731
    run(engine, [EngineRequest("done", prompt(tok, "x"), SamplingParams(max_tokens=200, temperature=0.0,
                                                                         grammar=spec(ENUMS)))])
    assert constrained() == 0
    engine.add(EngineRequest("a", prompt(tok, "x"), SamplingParams(max_tokens=200, grammar=spec(PERSON))))
    engine.step()                           # alone: the step waits for its grammar, then admits it
    engine.add(EngineRequest("free", prompt(tok, "y"), SamplingParams(max_tokens=4)))
    engine.step()                           # both admitted: each takes a row
    assert constrained() == 1 and engine.num_running == 2
    engine.cancel("a")
    assert constrained() == 0               # its row is given back at once
    while engine.has_work:
        engine.step()
    assert constrained() == 0
    # a schema that cannot compile: refused before it is counted
    refusal(engine, EngineRequest("b", prompt(tok, "x"), SamplingParams(max_tokens=8, grammar={"type": "regex"})))
    assert constrained() == 0
