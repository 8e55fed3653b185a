"""Grammar compilation off the engine thread (issue 34 item 4; worker.engine.grammar_compile):
while a pathological schema compiles, the batch keeps stepping and the other streams keep
getting tokens; the request waits and joins afterwards. The limits (schema bytes, compile time,
cache bytes) refuse with `invalid_request` naming `response_format` or `tools`, and count.

In process, on the tiny random Llama with SmolLM2's tokenizer. No wall-clock gaps are compared:
the stall test asserts that the engine thread made steps, and a stream received tokens, while
the compile was observably still running (its future not done), which fails if the compile ever
runs in the engine's step again and holds on a loaded 2-core box (a counted repetition compiles
for a second or more, the tiny model steps in milliseconds).
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from shared.errors import ErrorCode
from shared.sampling import SamplingParams
from shared.streams import RequestEntry
from worker.engine import Engine, EngineConfig, EngineRequest
from worker.engine.grammar_compile import GrammarLimits
from worker.engine_client import Add, Cancel
from worker.engine_thread import EngineThread
from worker.metrics import WorkerMetrics
from worker.telemetry import Telemetry

_unique = itertools.count(10_000 + int(time.time()) % 1000)


def pathological() -> dict:
    """The documented slow kind: a large counted repetition (~1-2 s to compile; a fresh bound
    every call so no cache can answer it)."""
    return {"type": "json_schema", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "minLength": next(_unique)}}, "required": ["a"]}}


SMALL = {"type": "json_schema", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                            "required": ["ok"]}}


def make_engine(model, tok, **limits) -> Engine:
    return Engine(model, tok, EngineConfig(max_batch=4, max_seq_len=2048, prefill_chunk=64,
                                           grammar=GrammarLimits(**limits)))


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def wait_until(predicate, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return bool(predicate())
        time.sleep(0.002)
    return True


def test_the_batch_keeps_stepping_while_a_pathological_schema_compiles(model, tokenizer):
    """The worker's driver (EngineThread) with a stream running: a request whose schema takes
    seconds to compile is added; while its compile is running the engine thread keeps stepping
    and the stream keeps receiving tokens; the request then joins and runs."""
    engine = make_engine(model, tokenizer, compile_timeout_s=600)
    received: dict[str, list] = {}
    lock = threading.Lock()

    def drain():      # in the engine thread, after each step with outputs
        with lock:
            for out in thread.take_outputs():
                received.setdefault(out.rid, []).append(out)

    thread = EngineThread(engine, max_prompt_tokens=512, buffer_max=100_000, on_output=drain)
    thread.start()
    try:
        thread.submit(Add(RequestEntry(rid="plain", prompt="Once upon a time",
                                       params=SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True))))
        tokens = lambda rid: sum(len(o.token_ids) for o in received.get(rid, []))   # noqa: E731
        assert wait_until(lambda: tokens("plain") >= 3, 60)
        thread.submit(Add(RequestEntry(rid="slow", prompt="JSON:",
                                       params=SamplingParams(max_tokens=4, temperature=0.0, grammar=pathological()))))
        assert wait_until(lambda: engine.compile_of("slow") is not None and engine.compile_of("slow").started.is_set(), 60)
        job = engine.compile_of("slow")
        steps, got = thread.steps, tokens("plain")
        # the engine steps on and the stream gets tokens while the compile is still running
        assert wait_until(lambda: thread.steps >= steps + 5 and tokens("plain") >= got + 5 or job.future.done(), 120)
        assert not job.future.done(), "the engine did not step while the schema compiled"
        assert "slow" not in received               # the request itself waits for its grammar
        # cancelled now, while its 1,900 tokens are far from done (a quiet box runs them out
        # before a multi-second compile ends: cancelling after it would race the length limit)
        thread.submit(Cancel("plain"))
        assert wait_until(lambda: any(o.finished for o in received.get("plain", [])), 60)
        assert received["plain"][-1].finish_reason == "cancelled"
        assert job.future.exception(timeout=300) is None
        assert wait_until(lambda: any(o.finished for o in received.get("slow", [])), 120)
        final = received["slow"][-1]
        assert final.finish_reason == "length" and tokens("slow") == 4, final
        tel = thread.take_telemetry()
        assert len(tel.compiles) == 1 and tel.compiles[0] > 0 and tel.refusals == []
    finally:
        thread.stop()


def test_a_compile_past_its_timeout_refuses_its_request_only(model, tokenizer):
    engine = make_engine(model, tokenizer, compile_timeout_s=0.05)
    engine.add(EngineRequest("slow", ids(tokenizer, "JSON:"), SamplingParams(max_tokens=4, grammar=pathological())))
    engine.add(EngineRequest("free", ids(tokenizer, "Hi"), SamplingParams(max_tokens=3, temperature=0.0)))
    finals = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                finals[out.rid] = out
    slow = finals["slow"]
    assert (slow.finish_reason, slow.error_code, slow.error_param) == ("error", ErrorCode.INVALID_REQUEST,
                                                                       "response_format"), slow
    assert slow.error_message.startswith("response_format: ") and "GRAMMAR_COMPILE_TIMEOUT_S" in slow.error_message
    assert finals["free"].finish_reason == "length" and finals["free"].completion_tokens == 3
    assert engine.take_grammar_records()[1] == ["timeout"]


def test_limits_refuse_with_the_field_the_schema_came_from(model, tokenizer):
    """Over GRAMMAR_MAX_SCHEMA_BYTES: refused before any compile, naming `tools` for a forced
    call's schema (shared.structured.grammar_for marks it) and `response_format` otherwise; a
    schema xgrammar cannot use is `invalid`. The cache limit reaches xgrammar's compiler."""
    engine = make_engine(model, tokenizer, max_schema_bytes=200, cache_bytes=1 << 20)
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20)}}
    cases = {"tool": ({"type": "json_schema", "schema": big, "param": "tools"}, "tools", "too_large"),
             "fmt": ({"type": "json_schema", "schema": big}, "response_format", "too_large"),
             "bad": ({"type": "json_schema", "schema": {"type": "string", "pattern": "(("}}, "response_format", "invalid"),
             "ok": (SMALL, None, None)}
    for rid, (grammar, _, _) in cases.items():
        engine.add(EngineRequest(rid, ids(tokenizer, "x"), SamplingParams(max_tokens=40, temperature=0.0,
                                                                          grammar=grammar)))
    finals = {}
    while engine.has_work:
        finals.update((o.rid, o) for o in engine.step() if o.finished)
    for rid, (_, param, _) in cases.items():
        out = finals[rid]
        if param is None:
            assert out.finish_reason in ("stop", "length") and out.error_code is None, out
            continue
        assert (out.error_code, out.error_param) == (ErrorCode.INVALID_REQUEST, param), out
        assert out.error_message.startswith(f"{param}: ")
    assert "GRAMMAR_MAX_SCHEMA_BYTES" in finals["tool"].error_message
    durations, refusals = engine.take_grammar_records()
    assert sorted(refusals) == ["invalid", "too_large", "too_large"]
    assert len(durations) == 2                       # "bad" and "ok" ran xgrammar; the large ones never did
    assert engine.grammars.compile_pool.compiler().cache_limit_bytes == 1 << 20


def test_a_request_cancelled_while_its_grammar_compiles_ends_cancelled(model, tokenizer):
    engine = make_engine(model, tokenizer)
    engine.add(EngineRequest("c", ids(tokenizer, "x"), SamplingParams(max_tokens=4, grammar=pathological())))
    assert engine.has_work and engine.num_waiting == 1 and engine.request_ids() == ["c"]
    assert engine.cancel("c")
    (final,) = engine.step()
    assert (final.rid, final.finish_reason, final.token_ids) == ("c", "cancelled", [])
    assert not engine.has_work and engine.request_ids() == [] and engine.compile_of("c") is None


@pytest.mark.parametrize("reasons", [["timeout", "too_large"], []])
def test_compile_records_reach_the_worker_metrics(reasons):
    """Compile seconds and refusals cross the engine pipe (Telemetry.pack) into the histogram and
    the counter, every reason present from the start."""
    tel = Telemetry.unpack(Telemetry(compiles=[0.003, 1.7], refusals=reasons).pack())
    metrics = WorkerMetrics()
    metrics.pump(tel)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in metrics.registry.collect() for s in family.samples}
    assert samples[("worker_grammar_compile_seconds_count", ())] == 2
    assert samples[("worker_grammar_compile_seconds_bucket", (("le", "2.5"),))] == 2
    assert samples[("worker_grammar_compile_seconds_bucket", (("le", "1.0"),))] == 1
    for reason in ("too_large", "timeout", "invalid"):
        assert samples[("worker_grammar_compile_refused_total", (("reason", reason),))] == reasons.count(reason)


def test_forced_call_parameters_with_defs_compile_and_validate(model, tokenizer):
    """pydantic's and LangChain's `parameters` carry `$defs` with "#/$defs/..." refs; wrapped in
    the call schema those pointed at the wrong root (found by the fuzz: every such forced call
    was refused). Each tool's definitions now move to the grammar's root, namespaced, and the
    calls the model makes validate against the tools' own parameters."""
    import json

    import jsonschema

    from shared.structured import NamedToolChoice, Tool, grammar_for
    city = {"$defs": {"City": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                               "required": ["name"]}},
            "type": "object", "properties": {"city": {"$ref": "#/$defs/City"},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"]}
    count = {"$defs": {"City": {"enum": ["a", "b"]}}, "type": "object",
             "properties": {"of": {"$ref": "#/$defs/City"}}, "required": ["of"]}
    tools = [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": p}})
             for n, p in (("weather", city), ("count", count))]
    engine = make_engine(model, tokenizer)
    for k, choice in enumerate(["required", NamedToolChoice.model_validate({"function": {"name": "count"}})]):
        spec = grammar_for(None, tools, choice)
        for seed in range(2):
            rid = f"{k}-{seed}"
            engine.add(EngineRequest(rid, ids(tokenizer, "call"), SamplingParams(max_tokens=120, temperature=1.0,
                                                                                 seed=seed, grammar=spec)))
            text, final = "", None
            while final is None:
                for out in engine.step():
                    text += out.text
                    final = out if out.finished else final
            assert final.finish_reason == "stop", (final, text)
            call = json.loads(text)
            jsonschema.validate(call["arguments"], {"weather": city, "count": count}[call["name"]])
            assert k == 0 or call["name"] == "count"
